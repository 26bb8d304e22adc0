# Prometheus from Debian's package, for hosts that reach no image registry (docker/smoke.sh);
# compose.yaml pulls prom/prometheus instead. No build context is needed:
#   podman build -f docker/debian/prometheus.Dockerfile -t conveyor-prometheus docker/debian
# The configuration is mounted at run time, as in compose.yaml.
ARG BASE=conveyor-base:bookworm
FROM ${BASE}

RUN apt-get update && apt-get install -y --no-install-recommends prometheus \
    && rm -rf /var/lib/apt/lists/*

USER prometheus
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/var/lib/prometheus/metrics2"]
