# dpsql serve in a container, on a policy (and its data) mounted at /data.
#
# UNTESTED: written where no container runtime could run (a docker client but no daemon, and
# installing one was out of scope); the same wheel is smoke-tested by .ci/wheel_smoke.
#
#   docker build -t dpsql .
#   dpsql init mydata.csv -o /srv/dpsql/policy.toml   # review every "decide:" line, then
#   dpsql check /srv/dpsql/policy.toml                 # (the data file sits next to it)
#   chown -R 10001 /srv/dpsql                          # the ledger and users file go there
#   echo 's3cret' | docker run -i --rm -v /srv/dpsql:/data dpsql \
#       user add alice --policy /data/policy.toml --password-stdin
#   docker run -d --name dpsql -p 127.0.0.1:5433:5433 -v /srv/dpsql:/data dpsql
#   psql "host=127.0.0.1 port=5433 user=alice dbname=policy"
#
# Other arguments replace the default command, e.g. TLS (put the PEM files in /data):
#   docker run ... dpsql serve --policy /data/policy.toml --host 0.0.0.0 \
#       --tls-cert /data/server.crt --tls-key /data/server.key --tls-required

FROM python:3.11-slim AS build
WORKDIR /src
COPY . .
RUN pip install --no-cache-dir build && python -m build --wheel --outdir /dist .

FROM python:3.11-slim
COPY --from=build /dist/ /tmp/dist/
RUN pip install --no-cache-dir /tmp/dist/*.whl \
    && rm -rf /tmp/dist \
    && useradd --create-home --uid 10001 dpsql
USER dpsql
WORKDIR /data
VOLUME /data
EXPOSE 5433
ENTRYPOINT ["dpsql"]
# 0.0.0.0 inside the container; publish the port on 127.0.0.1 unless clients come from elsewhere
CMD ["serve", "--policy", "/data/policy.toml", "--host", "0.0.0.0", "--port", "5433"]
