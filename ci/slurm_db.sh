# ci/slurm_db.sh - the accounting side of the CI cluster: MariaDB and slurmdbd.
# Sourced by ci/slurm_up.sh after ci/slurm_lib.sh (uses its paths, log, die and
# process helpers); see the notes at the top of slurm_up.sh for the behaviour.
#
# MariaDB listens on its unix socket only (skip-networking: no TCP port at
# all); slurmdbd reaches it there as "localhost" with its own user and a random
# password kept in slurmdbd.conf (root, 0600). slurmdbd itself listens on
# DbdPort 6819 like slurmctld on 6817 and slurmd on 6818 (all on every
# address, slurm's default); slurmctld talks to it on 127.0.0.1.

DB_NAME=slurm_acct_db
DB_USER=slurm
DBD_PORT=6819
DB_TIMEOUT="${SLURM_CI_DB_TIMEOUT:-60}"

# Writes `new` to `dest` (mode, owner root) if its content differs; returns 0
# when it wrote, 1 when the file was already up to date.
update_file() { # new dest mode
    if [ -f "$2" ] && cmp -s "$1" "$2"; then return 1; fi
    install -m "$3" -o root -g root "$1" "$2.tmp"
    mv -f "$2.tmp" "$2"
}

# ------------------------------------------------------------ configuration
db_write_configs() {
    local new_cnf new_dbd password
    new_cnf=$(mktemp)
    new_dbd=$(mktemp)  # 0600 from mktemp: it holds the database password
    cat >"$new_cnf" <<'EOF'
# Written by ci/slurm_up.sh: the SLURM accounting database of the one-node CI
# cluster. Read after Debian's 50-server.cnf. Do not edit by hand.
[mysqld]
# unix socket only (/run/mysqld/mysqld.sock): no TCP listener at all
skip-networking
# slurmdbd logs "Database settings not recommended values" below half of its
# recommendations (1 GB buffer pool, 64 MB redo log, 900 s lock wait). The pool
# is allocated as used: a CI database stays far below it.
innodb_buffer_pool_size = 512M
innodb_log_file_size = 64M
innodb_lock_wait_timeout = 900
EOF
    MYSQL_CNF_CHANGED=0
    install -d -m 0755 "$(dirname "$MYSQL_CNF")"
    if update_file "$new_cnf" "$MYSQL_CNF" 0644; then
        MYSQL_CNF_CHANGED=1
        log "wrote $MYSQL_CNF"
    fi

    password=$(sed -n 's/^StoragePass=//p' "$DBD_CONF" 2>/dev/null | tail -n1 || true)
    [ -n "$password" ] || password=$(od -An -N24 -tx1 /dev/urandom | tr -d ' \n')
    cat >"$new_dbd" <<EOF
# Written by ci/slurm_up.sh - accounting daemon of the CI cluster. Do not edit.
AuthType=auth/munge
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=${DBD_PORT}
SlurmUser=root
DebugLevel=info
LogFile=${LOG_DIR}/slurmdbd.log
PidFile=${DBD_PID}
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageLoc=${DB_NAME}
StorageUser=${DB_USER}
StoragePass=${password}
EOF
    DB_PASS=$password
    DBD_CONF_CHANGED=0
    # slurmdbd refuses a slurmdbd.conf readable by others or not owned by SlurmUser
    if update_file "$new_dbd" "$DBD_CONF" 0600; then
        DBD_CONF_CHANGED=1
        log "wrote $DBD_CONF"
    fi
    rm -f "$new_cnf" "$new_dbd"
}

# Waits until `check` passes; dies at once if no process `comm` is left (after
# a 2 s grace: a daemon may still be forking) rather than after the timeout.
wait_daemon() { # comm check
    local since
    since=$(date +%s)
    wait_for "$DB_TIMEOUT" daemon_ready "$1" "$2" "$since" || die "$1 does not answer after ${DB_TIMEOUT}s"
}
daemon_ready() { # comm check since
    "$2" && return 0
    [ $(( $(date +%s) - $3 )) -lt 2 ] || [ -n "$(pids_of "$1")" ] || die "$1 exited while starting"
    return 1
}

# ------------------------------------------------------------------ MariaDB
mysql_ok() { timeout 10 mariadb-admin --socket="$MYSQL_SOCK" ping >/dev/null 2>&1; }
# root logs in through the socket with unix_socket authentication (Debian's default)
mysql_root() { timeout 20 mariadb --socket="$MYSQL_SOCK" -uroot "$@"; }
db_user_ok() {
    MYSQL_PWD="$DB_PASS" timeout 10 mariadb --socket="$MYSQL_SOCK" -u"$DB_USER" "$DB_NAME" \
        -e 'SELECT 1' >/dev/null 2>&1
}

mariadb_up() {
    local pid
    install -d -o mysql -g mysql -m 0755 "$MYSQL_RUN"
    install -d -o mysql -g adm -m 2750 "$(dirname "$MYSQL_LOG")"
    if pid=$(alive_pid "$MYSQL_PID" mariadbd); then
        if [ "$MYSQL_CNF_CHANGED" = 1 ]; then
            # e.g. started by the package's postinst before our settings existed
            stop_pids "mariadbd (settings changed)" 30 "$pid" || true
        elif ! mysql_ok; then
            log "mariadbd (pid $pid) is not answering, restarting it"
            stop_pids mariadbd 30 "$pid" || true
        fi
    fi
    if pid=$(alive_pid "$MYSQL_PID" mariadbd); then
        log "mariadbd already running (pid $pid)"
    else
        if [ ! -d "$MYSQL_DATA/mysql" ]; then
            # the package's postinst creates it; it is gone if someone removed the state
            log "initialising $MYSQL_DATA (mariadb-install-db)"
            mariadb-install-db --user=mysql --datadir="$MYSQL_DATA" --skip-test-db \
                >/tmp/slurm_up.mariadb-install-db.log 2>&1 \
                || { tail -n 30 /tmp/slurm_up.mariadb-install-db.log >&2; die "mariadb-install-db failed"; }
        fi
        log "starting mariadbd"
        # mariadbd does not detach by itself: own session, parent pid 1, like the
        # slurm daemons; it logs to stderr (no log_error set)
        setsid -f /usr/sbin/mariadbd --user=mysql </dev/null >>"$MYSQL_LOG" 2>&1 \
            || die "mariadbd failed to start"
    fi
    wait_daemon mariadbd mysql_ok

    if ! db_user_ok; then
        log "creating database $DB_NAME and its user $DB_USER"
        mysql_root <<EOF || die "could not create database $DB_NAME and user $DB_USER"
CREATE DATABASE IF NOT EXISTS ${DB_NAME};
CREATE USER IF NOT EXISTS '${DB_USER}'@'localhost';
ALTER USER '${DB_USER}'@'localhost' IDENTIFIED BY '${DB_PASS}';
GRANT ALL ON ${DB_NAME}.* TO '${DB_USER}'@'localhost';
EOF
        db_user_ok || die "user $DB_USER cannot log in to $DB_NAME"
    fi
    log "MariaDB OK ($DB_NAME on $MYSQL_SOCK, no TCP port)"
}

# highest job id in the accounting database (0 if none), for FirstJobId at cold starts
db_max_job_id() {
    mysql_root -N -B "$DB_NAME" -e "SELECT COALESCE(MAX(id_job), 0) FROM ${CLUSTER}_job_table" 2>/dev/null \
        || echo 0
}

# ----------------------------------------------------------------- slurmdbd
# sacctmgr reads slurm.conf (AccountingStorageHost/Port) to find slurmdbd;
# the cluster list doubles as the liveness check (one sacctmgr call, ~0.2 s)
dbd_clusters() { timeout 10 sacctmgr -n -P list cluster format=cluster 2>/dev/null; }
dbd_ok() { DBD_CLUSTERS=$(dbd_clusters); }

slurmdbd_up() {
    local pid
    DBD_CLUSTERS=""
    if pid=$(alive_pid "$DBD_PID" slurmdbd); then
        if [ "$DBD_CONF_CHANGED" = 1 ]; then
            stop_pids "slurmdbd (slurmdbd.conf changed)" 10 "$pid" || true
        elif ! dbd_ok; then
            log "slurmdbd (pid $pid) is not answering, restarting it"
            stop_pids slurmdbd 10 "$pid" || true
        fi
    fi
    if pid=$(alive_pid "$DBD_PID" slurmdbd); then
        log "slurmdbd already running (pid $pid)"
    else
        log "starting slurmdbd"
        # detaches by itself; creates its tables on the first start
        slurmdbd || die "slurmdbd failed to start"
        wait_daemon slurmdbd dbd_ok
    fi

    # slurmctld only sends job records for a cluster the database knows
    if ! grep -qx "$CLUSTER" <<<"$DBD_CLUSTERS"; then
        log "registering cluster $CLUSTER (sacctmgr add cluster)"
        timeout 20 sacctmgr -i add cluster "$CLUSTER" >/dev/null || die "sacctmgr add cluster $CLUSTER failed"
        dbd_ok && grep -qx "$CLUSTER" <<<"$DBD_CLUSTERS" || die "cluster $CLUSTER not registered in slurmdbd"
    fi
    log "slurmdbd OK (cluster $CLUSTER registered, port $DBD_PORT)"
}

db_diagnostics() {
    echo "## mariadb-admin ping"; timeout 10 mariadb-admin --socket="$MYSQL_SOCK" ping 2>&1 || true
    echo "## sacctmgr list cluster"; timeout 10 sacctmgr -n -P list cluster 2>&1 || true
    for f in "$LOG_DIR/slurmdbd.log" "$MYSQL_LOG"; do
        echo "## tail $f"; tail -n 30 "$f" 2>&1 || true
    done
}
