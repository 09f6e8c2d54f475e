# One image for every gpusched service; the command picks the service:
#   docker run gpusched:0.1.0-cpu gpusched service scheduler
# Two builds, tagged <version>-cpu and <version>-cuda (compose.yaml, compose.gpu.yaml):
#   docker build -t gpusched:0.1.0-cpu .
#   docker build -t gpusched:0.1.0-cuda --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .
FROM python:3.11-slim

WORKDIR /opt/gpusched
# The CPU build of torch keeps the image small; compose.gpu.yaml runs node agents on
# hosts with NVIDIA GPUs, where a CUDA build can be installed with TORCH_INDEX instead.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN pip install --no-cache-dir --index-url "$TORCH_INDEX" "torch==2.13.0"

COPY pyproject.toml setup.py README.md ./
COPY libs ./libs
COPY services ./services
# every extra: the training worker (torch, installed above) and NVML for real GPUs
RUN pip install --no-cache-dir ".[all]"

# Services, and the jobs a node agent starts, run as an unprivileged user; /work (the
# node agents' checkpoints and job logs) belongs to it, so a volume mounted there does too.
# compose runs no service as another user (tests/test_compose_monitoring.py checks).
RUN useradd --create-home --uid 10001 gpusched && mkdir /work && chown gpusched /work \
    && useradd --system --no-create-home --shell /usr/sbin/nologin --user-group gpusched-job
USER gpusched
ENV GPUSCHED_LOG_LEVEL=info \
    PYTHONUNBUFFERED=1
EXPOSE 8080
CMD ["gpusched", "--help"]
