"""The training worker: the process a node agent starts for each run of a job.

It trains the real architecture of the job's model name on a GPU (ResNet-50, BERT-base, ...:
``registry``, ``architectures``) and, on the CPU, a tiny model from the built-in zoo (mlp,
cnn, transformer) that stands in for it; it reports progress, checkpoints and resumes
through :mod:`gpusched.libs.sdk`.
Run it with ``python -m gpusched.services.nodeagent.worker`` (``--help`` lists the flags), or with
``--profile`` to measure iteration time and memory over batch sizes. Importing this package
does not import torch.
"""
