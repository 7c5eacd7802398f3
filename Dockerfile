# multimesh and its trainer on NVIDIA GPUs: JAX's CUDA 13 wheels (the host needs NVIDIA driver 580 or newer),
# every other package at the exact versions of requirements/lock.txt. The CUDA libraries come from JAX's wheels;
# the base image gives the NVIDIA container runtime its driver check. Build, push, run (docs/install.md):
#   docker build -t multimesh:0.1.0-cuda13 .
#   docker tag multimesh:0.1.0-cuda13 registry.example.com/multimesh:0.1.0-cuda13   # your registry
#   docker run --rm --gpus all --shm-size=16g multimesh:0.1.0-cuda13 tiny train.steps=100
# deploy/jobset.yaml (Kubernetes) and deploy/train.sbatch (SLURM with pyxis) run this image.
FROM nvidia/cuda:13.1.1-base-ubuntu24.04

ARG DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.12 python3.12-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/*

# MULTIMESH_PLATFORM=gpu: the trainer refuses to run on CPU (no GPU visible, a driver too old) instead of
# training slowly there
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    MULTIMESH_PLATFORM=gpu
RUN python3.12 -m venv /opt/venv \
 && pip install --no-cache-dir --upgrade pip

# editable: the trainer reads its configs from the clone's configs/
WORKDIR /opt/multimesh
COPY pyproject.toml README.md ./
COPY requirements/lock.txt requirements/lock.txt
COPY multimesh/ multimesh/
COPY models/ models/
COPY trainers/ trainers/
COPY configs/ configs/
RUN pip install --no-cache-dir -e ".[cuda13]" -c requirements/lock.txt \
 && python -c "import jax, multimesh; print('jax', jax.__version__)"

ENTRYPOINT ["multimesh-train"]
CMD ["--help"]
