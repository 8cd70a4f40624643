# HiSparse Decode Server image (docs/deploy.md).
#   CUDA (default target `cuda`): docker build -t hisparse-decode-server:cuda .
#   CPU (runs anywhere, e.g. the embedded tiny-dsa model): docker build --target cpu -t hisparse-decode-server:cpu .
# Every base image is a build argument, so a registry mirror or an air-gapped base can stand in; pip honours
# --build-arg PIP_INDEX_URL=... / PIP_EXTRA_INDEX_URL=... the same way (and a pip.conf or CA bundle the base image
# carries). No `# syntax=` line on purpose: it makes BuildKit fetch its frontend from a registry before anything
# else, so the build needs no registry beyond the bases. No secret is baked in: the API key is given at run time
# (--api-key, from a Kubernetes Secret or an environment variable).

# CUDA runtime base of the default target: CUDA 13.0, the CUDA line of the torch wheel pinned below.
ARG BASE_IMAGE=nvidia/cuda:13.0.1-runtime-ubuntu24.04
# Same CUDA release with nvcc, for the ahead-of-time build of the swap-in extension.
ARG BUILD_BASE_IMAGE=nvidia/cuda:13.0.1-devel-ubuntu24.04
# Slim Python base of the CPU target and of the wheel build: any Debian or Ubuntu image with python3 (3.11 or
# newer) and its venv module (e.g. a debootstrap of bookworm with python3-venv) stands in.
ARG CPU_BASE_IMAGE=python:3.11-slim-bookworm

# ---- stage 1: the project's wheel (pure Python; the CUDA sources ride along as package data) ----
FROM ${CPU_BASE_IMAGE} AS wheel
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
WORKDIR /src
# .dockerignore admits only what the wheel is built from (pyproject.toml, README.md, configs/ and the packages).
COPY . .
RUN python3 -m venv /opt/build \
    && /opt/build/bin/pip wheel --no-cache-dir --no-deps --wheel-dir /wheels . \
    && basename /wheels/hisparse_decode_server-*.whl > /wheels/wheel-name.txt

# ---- CPU runtime ----
FROM ${CPU_BASE_IMAGE} AS cpu
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH \
    HISPARSE_CACHE_DIR=/var/cache/hisparse \
    DECODE_SERVER_HEALTH_URL=http://127.0.0.1:30000/health
# libibverbs1, libnuma1 and libcurl4: the transfer engine's wheel links them even for TCP transfers (the
# `check-libs` step below fails the build if any library a wheel links is missing).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends libibverbs1 libnuma1 libcurl4 \
    && rm -rf /var/lib/apt/lists/*
# torch's arguments are declared here, after the apt step: every ARG in scope is part of each later RUN's cache key.
ARG TORCH_VERSION=2.13.0
# Where the CPU build of torch comes from (docs/deploy.md): PyTorch's CPU index, which serves its dependencies
# too; or, when TORCH_FIND_LINKS names a directory of wheels holding it (a URL), that directory, with the
# dependencies from the ordinary index. Both empty: the ordinary index's torch (on PyPI the CUDA build, ~5 GB
# more). A CPU source that yields a CUDA build fails the build. (DL3013: torch is pinned; hadolint reads the
# "$@" of source options as an unpinned package.)
ARG TORCH_CPU_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_FIND_LINKS=
# hadolint ignore=DL3013
RUN python3 -m venv /opt/venv \
    && if [ -n "${TORCH_FIND_LINKS}" ]; then set -- --find-links "${TORCH_FIND_LINKS}"; \
       elif [ -n "${TORCH_CPU_INDEX_URL}" ]; then set -- --index-url "${TORCH_CPU_INDEX_URL}"; \
       else set --; fi \
    && pip install --no-cache-dir "$@" "torch==${TORCH_VERSION}" \
    && if [ "$#" -gt 0 ]; then python -c "import sys, torch; sys.exit(torch.version.cuda and \
       f'torch {torch.__version__} is a CUDA build: the CPU source has no CPU build of torch=={sys.argv[1]}')" \
       "${TORCH_VERSION}"; fi
# Extras installed with the wheel (`pd`: the non-CUDA build of the mooncake transfer engine, for PD roles).
ARG EXTRAS=pd
COPY --from=wheel /wheels /wheels
RUN pip install --no-cache-dir "/wheels/$(cat /wheels/wheel-name.txt)[${EXTRAS}]" \
    && rm -rf /wheels \
    && python -m decode_server.ops check-libs
RUN useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin hisparse \
    && mkdir -p /models /var/cache/hisparse \
    && chown hisparse:hisparse /var/cache/hisparse
USER 10001
WORKDIR /home/hisparse
# Model checkpoints: mount a directory here and pass --model-path /models/<name> (tiny-dsa needs none).
VOLUME ["/models"]
EXPOSE 30000 8998 8000
HEALTHCHECK --interval=30s --timeout=10s --start-period=120s --retries=3 \
    CMD ["python", "-m", "decode_server.ops", "probe"]
ENTRYPOINT ["decode-server"]
CMD ["serve", "--model-path", "tiny-dsa", "--device", "cpu", "--host", "0.0.0.0", "--port", "30000"]

# ---- CUDA extension, compiled ahead of time (no GPU needed; one build per architecture) ----
FROM ${BUILD_BASE_IMAGE} AS cuda-build
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG TORCH_VERSION=2.13.0
# 80 = A100, 90a = H100/H200, 100 = B200 (names as kernels/cuda_ext.py derives them from the device).
ARG CUDA_ARCHS="80 90a 100"
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/venv/bin:$PATH
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv \
    && pip install --no-cache-dir "torch==${TORCH_VERSION}" ninja==1.13.2
COPY --from=wheel /wheels /wheels
# The package is installed here only to run the build; the runtime stage installs the wheel with its extras.
RUN pip install --no-cache-dir --no-deps "/wheels/$(cat /wheels/wheel-name.txt)" \
    && set -- && for arch in ${CUDA_ARCHS}; do set -- "$@" --arch "$arch"; done \
    && python -m decode_server.ops build-kernels "$@" --cache-dir /opt/hisparse/kernels \
    && pip uninstall -y hisparse-decode-server \
    && find /opt/hisparse/kernels -name '*.o' -delete

# ---- CUDA runtime (default target) ----
FROM ${BASE_IMAGE} AS cuda
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
# `pd-cuda13`: the transfer engine's wheel built for CUDA 13, the CUDA line of this image's torch; `structured`:
# xgrammar for response_format / regex / ebnf (the CPU image leaves it out: it would bring triton along).
ARG EXTRAS=pd-cuda13,structured
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH \
    HISPARSE_CACHE_DIR=/var/cache/hisparse \
    HISPARSE_KERNEL_CACHE=/opt/hisparse/kernels \
    TRITON_CACHE_DIR=/var/cache/hisparse/triton \
    DECODE_SERVER_HEALTH_URL=http://127.0.0.1:30000/health
# python3-dev and gcc: Triton compiles its launcher at first use. libibverbs1, ibverbs-providers (mlx5 and
# other RDMA NIC drivers), librdmacm1, libnuma1, libcurl4 (on Ubuntu 24.04 apt takes libcurl4t64, which
# provides it): the transfer engine's RDMA and TCP paths.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-dev gcc libc6-dev \
       libibverbs1 ibverbs-providers librdmacm1 libnuma1 libcurl4 \
    && rm -rf /var/lib/apt/lists/*
# torch (CUDA build) comes with the build stage's virtualenv; the prebuilt kernels are stamped for it.
COPY --from=cuda-build /opt/venv /opt/venv
COPY --from=cuda-build /opt/hisparse/kernels /opt/hisparse/kernels
COPY --from=wheel /wheels /wheels
# check-libs: every library that torch, the transfer engine and Triton's core link must resolve (the driver's
# libcuda.so.1 is mounted at run time). Not all of site-packages: NVIDIA's wheels carry optional plugins
# (NVSHMEM's MPI/UCX/libfabric bootstraps, cuFile's RDMA) whose libraries this image does not need.
RUN pip install --no-cache-dir "/wheels/$(cat /wheels/wheel-name.txt)[${EXTRAS}]" \
    && rm -rf /wheels \
    && site="$(python -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')" \
    && python -m decode_server.ops check-libs --allow-driver "$site/torch" "$site/mooncake" "$site/triton/_C"
RUN useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin hisparse \
    && mkdir -p /models /var/cache/hisparse \
    && chown hisparse:hisparse /var/cache/hisparse
USER 10001
WORKDIR /home/hisparse
VOLUME ["/models"]
EXPOSE 30000 8998 8000
HEALTHCHECK --interval=30s --timeout=10s --start-period=1800s --retries=3 \
    CMD ["python", "-m", "decode_server.ops", "probe"]
ENTRYPOINT ["decode-server"]
CMD ["serve", "--model-path", "tiny-dsa", "--host", "0.0.0.0", "--port", "30000"]
