# partq: one image for every role; the first argument picks it
# (coordinator, consume, produce, stream, status).
#   docker build -t partq:0.3.0 .
#   docker run --rm partq:0.3.0 --help
# Your own handlers: build FROM this image and `pip install` your package, then
#   partq consume STREAM --handler your_pkg.module:function
# (a module in the working directory, /app, imports too: the image's examples package,
# examples.handlers, is there for the manifests' print handler).

# Stage 1: sdist and wheel, as `python -m build` makes them for a release; the file set is the
# package's own (pyproject.toml's packages), not a list of folders kept here.
FROM python:3.11-slim AS wheel

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1

WORKDIR /src
RUN pip install "build>=1.2"
COPY . .
RUN python -m build --outdir /dist .

# Stage 2: the wheel installed; no source tree, no build tools.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1

# A fixed uid so Kubernetes' runAsNonRoot/runAsUser can check it.
RUN groupadd --system --gid 10001 partq \
 && useradd --system --uid 10001 --gid partq --no-create-home --shell /usr/sbin/nologin partq

COPY --from=wheel /dist/ /tmp/dist/
RUN pip install /tmp/dist/partq-*.whl && rm -rf /tmp/dist
COPY --from=wheel /src/examples/__init__.py /src/examples/handlers.py /app/examples/

USER 10001:10001
WORKDIR /app
# 9400: coordinator (/metrics, /livez, /readyz, status page); 9401: consumer.
EXPOSE 9400 9401
ENTRYPOINT ["partq"]
CMD ["--help"]
