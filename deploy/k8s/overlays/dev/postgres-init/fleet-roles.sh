# The postgres image runs this once, on an empty data directory, before the
# server starts listening (it sources every *.sh in /docker-entrypoint-initdb.d;
# docker_process_sql is the image's psql as the bootstrap superuser).
#
# It creates fleet's roles with roles.psql (a byte-for-byte copy of
# deploy/postgres/roles.sql: kustomize reads files only below the overlay, and
# tests/deploy checks the copy) and gives them the passwords of fleet-secrets.
# psql reads the passwords from its environment (\getenv), so they never appear
# on a command line; the server stores a SCRAM hash.
docker_process_sql \
    -v migrator="${DB_MIGRATOR:-fleet_migrator}" \
    -v runtime="${DB_RUNTIME:-fleet_runtime}" \
    -v scaler="${DB_SCALER:-fleet_scaler}" \
    -f /docker-entrypoint-initdb.d/roles.psql
docker_process_sql \
    -v migrator="${DB_MIGRATOR:-fleet_migrator}" \
    -v runtime="${DB_RUNTIME:-fleet_runtime}" <<'SQL'
\getenv migrator_password DB_MIGRATOR_PASSWORD
\getenv runtime_password DB_RUNTIME_PASSWORD
ALTER ROLE :"migrator" PASSWORD :'migrator_password';
ALTER ROLE :"runtime" PASSWORD :'runtime_password';
SQL
