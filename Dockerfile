# partq: one image for every role; the first argument picks it
# (coordinator, consume, produce, stream, status).
#   docker build -t partq:dev .
#   docker run --rm partq:dev --help
# Your own handlers: build FROM this image and `pip install` your package, then
#   partq consume STREAM --handler your_pkg.module:function
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1

# A fixed uid so Kubernetes' runAsNonRoot/runAsUser can check it.
RUN groupadd --system --gid 10001 partq \
 && useradd --system --uid 10001 --gid partq --no-create-home --shell /usr/sbin/nologin partq

WORKDIR /opt/partq
COPY pyproject.toml README.md ./
COPY producer/ producer/
COPY coordinator/ coordinator/
COPY consumers/ consumers/
# Installed, not run from source: the source tree goes once it is built.
RUN pip install . && cd / && rm -rf /opt/partq

USER 10001:10001
WORKDIR /tmp
# 9400: coordinator (/metrics, /livez, /readyz, status page); 9401: consumer.
EXPOSE 9400 9401
ENTRYPOINT ["partq"]
CMD ["--help"]
