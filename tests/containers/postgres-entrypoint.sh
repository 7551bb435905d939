#!/bin/sh
# The official postgres image's first start, as far as docker-compose.yml uses it: an empty
# data folder is initialised with POSTGRES_USER (superuser) and POSTGRES_PASSWORD, the database
# POSTGRES_DB is created, and password logins are accepted from the network.
set -eu
mkdir -p "$PGDATA" /var/run/postgresql
chown postgres "$PGDATA" /var/run/postgresql
chmod 700 "$PGDATA"
if [ ! -s "$PGDATA/PG_VERSION" ]; then
    pwfile=$(mktemp)
    printf '%s' "$POSTGRES_PASSWORD" >"$pwfile"
    chown postgres "$pwfile"
    # UTF8, as the official image makes it (its locale is en_US.utf8): initdb in a bare
    # container would pick SQL_ASCII, whose text psycopg hands back as bytes.
    gosu postgres initdb -D "$PGDATA" -U "$POSTGRES_USER" --pwfile="$pwfile" \
        --encoding=UTF8 --locale=C.UTF-8 \
        --auth-local=trust --auth-host=scram-sha-256
    rm -f "$pwfile"
    echo "host all all all scram-sha-256" >>"$PGDATA/pg_hba.conf"
    gosu postgres pg_ctl -D "$PGDATA" -o "-c listen_addresses=''" -w start
    if [ "$POSTGRES_DB" != postgres ]; then
        gosu postgres psql -U "$POSTGRES_USER" -d postgres -c "CREATE DATABASE \"$POSTGRES_DB\""
    fi
    gosu postgres pg_ctl -D "$PGDATA" -m fast -w stop
fi
exec gosu postgres postgres -D "$PGDATA" -c listen_addresses='*'
