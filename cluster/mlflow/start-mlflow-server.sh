#!/usr/bin/env bash
# Start the MLflow tracking server that every Ray worker logs to:
#   - backend store: PostgreSQL (runs, params, metrics, tags)
#   - artifact store: proxied by the server (--artifacts-destination: s3://..., or a local
#     folder), so workers need no storage credentials, only HTTP access to this server
#   - authentication: MLflow's basic-auth app (users and permissions kept in a second
#     PostgreSQL database)
#
# Every setting comes from the environment, and no password is ever put on a command line
# (which `ps` would show): libpq reads the database password from PGPASSWORD (or
# ~/.pgpass), the auth app reads the admin password from MLFLOW_AUTH_ADMIN_PASSWORD.
#
# Required:
#   MLFLOW_DB_HOST                 PostgreSQL host
#   MLFLOW_DB_USER                 PostgreSQL role that owns both databases
#   PGPASSWORD                     its password (or a ~/.pgpass entry)
#   MLFLOW_AUTH_ADMIN_PASSWORD     password of the MLflow admin user, 12 characters or more
#                                  (the user is created on the first start)
#   MLFLOW_FLASK_SERVER_SECRET_KEY random string that signs the auth app's CSRF tokens; the
#                                  same value on every replica of the server
#   MLFLOW_ARTIFACTS_DESTINATION   s3://bucket/prefix (with AWS_* / MLFLOW_S3_ENDPOINT_URL)
#                                  or an absolute folder
# Optional (default):
#   MLFLOW_DB_PORT (5432), MLFLOW_DB_NAME (mlflow), MLFLOW_AUTH_DB_NAME (mlflow_auth)
#   MLFLOW_AUTH_ADMIN_USERNAME (admin), MLFLOW_AUTH_DEFAULT_PERMISSION (READ)
#   MLFLOW_HOST (127.0.0.1), MLFLOW_PORT (5000), MLFLOW_WORKERS (4)
#                                  the default serves this machine only; a container that
#                                  publishes the port sets 0.0.0.0 (its own interface) and
#                                  the deployment decides where it is published: on the
#                                  host's loopback (docker-compose.yaml), a ClusterIP Service
#                                  (cluster/kuberay/mlflow.yaml), or a TLS proxy in front
#                                  (cluster/README.md, "MLflow behind TLS"). The server
#                                  speaks plain HTTP: never publish it beyond a private network
#   MLFLOW_ALLOWED_HOSTS           comma-separated Host headers the server accepts; set it
#                                  to the name/IP the Ray workers use (e.g. mlflow,10.0.*)
#   MLFLOW_DB_WAIT_S (60)          how long to wait for PostgreSQL to accept connections
#   MLFLOW_AUTH_CACHE_TTL_S (0)    seconds a checked credential is cached in each server
#                                  worker; 0 checks the password hash (scrypt, ~0.1 s of
#                                  CPU) on every request. See docs/scale.md for what it
#                                  costs and the staleness a cache brings
#
# Usage: start-mlflow-server.sh            (exec's the server in the foreground)
set -euo pipefail

die() { echo "start-mlflow-server.sh: $*" >&2; exit 2; }

: "${MLFLOW_DB_HOST:?MLFLOW_DB_HOST must name the PostgreSQL host}"
: "${MLFLOW_DB_USER:?MLFLOW_DB_USER must name the PostgreSQL role}"
: "${MLFLOW_AUTH_ADMIN_PASSWORD:?MLFLOW_AUTH_ADMIN_PASSWORD must be set (the MLflow admin password)}"
: "${MLFLOW_FLASK_SERVER_SECRET_KEY:?MLFLOW_FLASK_SERVER_SECRET_KEY must be set (e.g. openssl rand -hex 32)}"
: "${MLFLOW_ARTIFACTS_DESTINATION:?MLFLOW_ARTIFACTS_DESTINATION must be s3://... or an absolute folder}"
if [[ -z "${PGPASSWORD:-}" && ! -f "${PGPASSFILE:-$HOME/.pgpass}" ]]; then
    die "no PostgreSQL password: set PGPASSWORD or provide ${PGPASSFILE:-$HOME/.pgpass}"
fi

db_port="${MLFLOW_DB_PORT:-5432}"
db_name="${MLFLOW_DB_NAME:-mlflow}"
auth_db_name="${MLFLOW_AUTH_DB_NAME:-mlflow_auth}"
host="${MLFLOW_HOST:-127.0.0.1}"
port="${MLFLOW_PORT:-5000}"
workers="${MLFLOW_WORKERS:-4}"
wait_s="${MLFLOW_DB_WAIT_S:-60}"

# No password in these URIs: psycopg2 (libpq) takes it from PGPASSWORD / ~/.pgpass.
backend_uri="postgresql+psycopg2://${MLFLOW_DB_USER}@${MLFLOW_DB_HOST}:${db_port}/${db_name}"
auth_uri="postgresql+psycopg2://${MLFLOW_DB_USER}@${MLFLOW_DB_HOST}:${db_port}/${auth_db_name}"

python=${PYTHON:-python}

# Wait until both databases accept connections (the database container may still start).
"$python" - "$backend_uri" "$auth_uri" "$wait_s" <<'PY'
import sys, time
import sqlalchemy
uris, wait_s = sys.argv[1:3], float(sys.argv[3])
deadline = time.monotonic() + wait_s
for uri in uris:
    while True:
        try:
            engine = sqlalchemy.create_engine(uri)
            with engine.connect():
                pass
            engine.dispose()
            break
        except Exception as error:  # noqa: BLE001 - report the last error after the deadline
            if time.monotonic() > deadline:
                safe = uri.split("@", 1)[-1]
                sys.exit(f"start-mlflow-server.sh: database {safe} not reachable "
                         f"after {wait_s:.0f} s: {type(error).__name__}: {error}")
            time.sleep(1)
PY

# The auth app reads its settings from an ini file (MLFLOW_AUTH_CONFIG_PATH). It holds no
# secret (the admin password stays in the environment), but keep it private anyway.
auth_ini="$(mktemp "${TMPDIR:-/tmp}/mlflow-basic-auth.XXXXXX")"
chmod 600 "$auth_ini"
cat >"$auth_ini" <<INI
[mlflow]
default_permission = ${MLFLOW_AUTH_DEFAULT_PERMISSION:-READ}
database_uri = ${auth_uri}
admin_username = ${MLFLOW_AUTH_ADMIN_USERNAME:-admin}
auth_cache_ttl_seconds = ${MLFLOW_AUTH_CACHE_TTL_S:-0}
authorization_function = mlflow.server.auth:authenticate_request_basic_auth
INI
export MLFLOW_AUTH_CONFIG_PATH="$auth_ini"
# The server's background job runner (GenAI jobs) is not used by the studies.
export MLFLOW_SERVER_ENABLE_JOB_EXECUTION="${MLFLOW_SERVER_ENABLE_JOB_EXECUTION:-false}"

args=(server
      --backend-store-uri "$backend_uri"
      --artifacts-destination "$MLFLOW_ARTIFACTS_DESTINATION"
      --serve-artifacts
      --host "$host" --port "$port" --workers "$workers"
      --app-name basic-auth)
if [[ -n "${MLFLOW_ALLOWED_HOSTS:-}" ]]; then
    args+=(--allowed-hosts "$MLFLOW_ALLOWED_HOSTS")
fi

echo "start-mlflow-server.sh: backend ${backend_uri#*@}, artifacts ${MLFLOW_ARTIFACTS_DESTINATION}, listening on ${host}:${port}" >&2
exec "$python" -m mlflow "${args[@]}"
