"""The training worker: the process a node agent starts for each run of a job.

It trains a tiny model from the built-in zoo (mlp, cnn, transformer) that stands in for
the job's profile name, reports progress, checkpoints and resumes through :mod:`gpusched.libs.sdk`.
Run it with ``python -m gpusched.services.nodeagent.worker`` (``--help`` lists the flags), or with
``--profile`` to measure iteration time and memory over batch sizes. Importing this package
does not import torch.
"""
