-- fleet's database roles: one changes the schema, one only reads and writes rows, one
-- only asks how much waits.
--
--   migrator  the fleet-db-upgrade Job (`fleet db upgrade`, Secret key
--             migration-database-url): owns fleet's schema and everything in it,
--             may create schemas in this database. Nothing else uses it.
--   runtime   every long-running process (worker, timers, recovery, attacher,
--             their wait-for-schema gates; Secret key database-url): SELECT,
--             INSERT, UPDATE, DELETE on fleet's tables and EXECUTE on its
--             functions, nothing more. It cannot create, alter, drop, truncate
--             or grant anything, so a compromised worker cannot change the
--             schema, replace the append functions or take the data out of the
--             migrator's hands.
--   scaler    KEDA's PostgreSQL scaler (components/keda; Secret fleet-keda-postgres;
--             decision 0046): EXECUTE on fleet's functions and no privilege on any
--             table. Only fleet_scaler_unowned and fleet_scaler_timers_due run with
--             their owner's rights (SECURITY DEFINER), and each answers one number;
--             every other function runs with the caller's, who may read and write
--             nothing. Optional (-v scaler=...; default fleet_scaler): it logs in
--             only once you give it a password.
--
-- Run it once per database, connected to that database as its owner or a
-- superuser (re-running it is harmless: it creates what is missing and grants
-- again):
--
--   psql "postgresql://admin@db.example.com/fleet" \
--        -v migrator=fleet_migrator -v runtime=fleet_runtime -v scaler=fleet_scaler \
--        -f deploy/postgres/roles.sql
--
-- (add -v idle_timeout=30s for another limit on idle transactions; see below)
--
-- then give the roles passwords without putting them on a command line
-- (psql's \password prompts and sends a SCRAM hash), or map them to your
-- cloud's IAM authentication:
--
--   \password fleet_migrator
--   \password fleet_runtime
--   \password fleet_scaler      (with KEDA only)
--
-- Both URLs name the same schema (?schema=fleet): the migrator creates it on
-- the first `fleet db upgrade`, and whatever the migrator creates from then on
-- the default privileges below hand to the runtime role. Tested against a real
-- server by tests/deploy/test_db_roles.py.
\set ON_ERROR_STOP on
\if :{?scaler}
\else
\set scaler fleet_scaler
\endif

SELECT format('CREATE ROLE %I LOGIN', :'migrator')
WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = :'migrator') \gexec
SELECT format('CREATE ROLE %I LOGIN', :'runtime')
WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = :'runtime') \gexec
SELECT format('CREATE ROLE %I LOGIN', :'scaler')
WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = :'scaler') \gexec

-- Nobody else creates objects in this database: before PostgreSQL 15 every role
-- may create tables in `public`, and every role may make temporary tables.
REVOKE CREATE ON SCHEMA public FROM PUBLIC;
SELECT format('REVOKE CREATE, TEMPORARY ON DATABASE %I FROM PUBLIC', current_database()) \gexec
SELECT format('GRANT CONNECT ON DATABASE %I TO %I, %I, %I',
              current_database(), :'migrator', :'runtime', :'scaler') \gexec
SELECT format('GRANT CREATE ON DATABASE %I TO %I', current_database(), :'migrator') \gexec

-- A stuck session must not hold the fleet up (issue 25 item 10): a transaction left
-- open anywhere on the server holds back the relay's feed (decision 0020), and a row
-- lock it holds stalls every write of that execution. Any session of this database
-- that sits idle inside a transaction longer than :idle_timeout (default 60s; an
-- operator's psql left after BEGIN, a client that hung mid-transaction) is ended by
-- the server. The runtime role's sessions also get fleet's statement limits (fleet's
-- own connections ask for them anyway). A session may SET its own values: these are
-- defaults against mistakes and hung clients, not a bound on a hostile role member.
\if :{?idle_timeout}
\else
\set idle_timeout 60s
\endif
SELECT format('ALTER DATABASE %I SET idle_in_transaction_session_timeout = %L',
              current_database(), :'idle_timeout') \gexec
SELECT format('ALTER ROLE %I SET statement_timeout = %L', :'runtime', '60s') \gexec
SELECT format('ALTER ROLE %I SET lock_timeout = %L', :'runtime', '10s') \gexec

-- What the migrator creates from now on: the runtime role may use it, rows only.
ALTER DEFAULT PRIVILEGES FOR ROLE :"migrator" GRANT USAGE ON SCHEMAS TO :"runtime";
ALTER DEFAULT PRIVILEGES FOR ROLE :"migrator"
    GRANT SELECT, INSERT, UPDATE, DELETE ON TABLES TO :"runtime";
ALTER DEFAULT PRIVILEGES FOR ROLE :"migrator" GRANT USAGE, SELECT ON SEQUENCES TO :"runtime";
ALTER DEFAULT PRIVILEGES FOR ROLE :"migrator" REVOKE EXECUTE ON FUNCTIONS FROM PUBLIC;
ALTER DEFAULT PRIVILEGES FOR ROLE :"migrator" GRANT EXECUTE ON FUNCTIONS TO :"runtime";
-- The scaler: the schema and its functions, no table (see the roles above).
ALTER DEFAULT PRIVILEGES FOR ROLE :"migrator" GRANT USAGE ON SCHEMAS TO :"scaler";
ALTER DEFAULT PRIVILEGES FOR ROLE :"migrator" GRANT EXECUTE ON FUNCTIONS TO :"scaler";

-- What the migrator already owns (a re-run, or a schema handed over with
-- `REASSIGN OWNED BY <old owner> TO <migrator>`): the same grants.
SELECT format('GRANT USAGE ON SCHEMA %I TO %I', n.nspname, :'runtime')
       || format('; GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA %I TO %I',
                 n.nspname, :'runtime')
       || format('; GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA %I TO %I',
                 n.nspname, :'runtime')
       || format('; REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA %I FROM PUBLIC', n.nspname)
       || format('; GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA %I TO %I', n.nspname, :'runtime')
       || format('; GRANT USAGE ON SCHEMA %I TO %I', n.nspname, :'scaler')
       || format('; GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA %I TO %I', n.nspname, :'scaler')
FROM pg_namespace AS n JOIN pg_roles AS r ON r.oid = n.nspowner
WHERE r.rolname = :'migrator' \gexec
