# ci/slurm_lib.sh - paths and process helpers shared by ci/slurm_up.sh and
# ci/slurm_down.sh (sourced, not run). The caller sets LOG_TAG first.

CONF_DIR=/etc/slurm
CONF="$CONF_DIR/slurm.conf"
DBD_CONF="$CONF_DIR/slurmdbd.conf"
LOG_DIR=/var/log/slurm
STATE_DIR=/var/spool/slurmctld
SPOOL_DIR=/var/spool/slurmd
CTLD_PID=/run/slurmctld.pid
SLURMD_PID=/run/slurmd.pid
DBD_PID=/run/slurmdbd.pid
MUNGE_PID=/run/munge/munged.pid
MUNGE_KEY=/etc/munge/munge.key
CLEAN_MARKER=/var/spool/slurmctld/clean_shutdown  # written by slurm_down.sh
# MariaDB: Debian's package, our settings in a drop-in read after Debian's own
MYSQL_CNF=/etc/mysql/mariadb.conf.d/90-slurm-ci.cnf
MYSQL_RUN=/run/mysqld
MYSQL_PID="$MYSQL_RUN/mysqld.pid"   # pid-file of Debian's 50-server.cnf
MYSQL_SOCK="$MYSQL_RUN/mysqld.sock"
MYSQL_DATA=/var/lib/mysql
MYSQL_LOG=/var/log/mysql/error.log
# written by earlier versions of slurm_up.sh, removed by this one
OLD_SACCT_SHIM=/usr/local/bin/sacct

T0=$(date +%s.%N)
elapsed() { echo "$(date +%s.%N) $T0" | awk '{printf "%.1f", $1 - $2}'; }
log() { echo "[$LOG_TAG +$(elapsed)s] $*"; }

# is pid a live (not zombie) process named comm?
running() { # pid [comm]
    local st
    [ -r "/proc/$1/stat" ] || return 1
    st=$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1)
    [ -n "$st" ] && [ "$st" != Z ] && [ "$st" != X ] || return 1
    [ -z "${2:-}" ] || [ "$(cat "/proc/$1/comm" 2>/dev/null)" = "$2" ]
}
# pids of live processes named exactly comm
pids_of() { # comm
    local pid
    for pid in $(pgrep -x "$1" 2>/dev/null); do running "$pid" "$1" && echo "$pid"; done | tr '\n' ' '
}
# pid of a running daemon: from its pidfile if that process is alive and has
# the expected name, else the oldest live process with exactly that name
alive_pid() { # pidfile comm
    local pid=""
    [ -s "$1" ] && pid=$(cat "$1" 2>/dev/null)
    if [ -n "$pid" ] && running "$pid" "$2"; then
        echo "$pid"
        return 0
    fi
    pid=$(pids_of "$2" | awk '{print $1}')
    [ -n "$pid" ] && echo "$pid"
}
# SIGTERM, wait up to `seconds`, then SIGKILL what is left (and return 1)
stop_pids() { # name seconds pid...
    local name=$1 tenths=$(( $2 * 10 )) pid left
    shift 2
    [ $# -gt 0 ] || return 0
    log "stopping $name (pid $*)"
    kill "$@" 2>/dev/null || true
    for _ in $(seq "$tenths"); do
        left=""
        for pid in "$@"; do running "$pid" && left="$left $pid"; done
        [ -z "$left" ] && return 0
        sleep 0.1
    done
    log "killing $name (pid$left)"
    # shellcheck disable=SC2086
    kill -9 $left 2>/dev/null || true
    return 1
}
# run `cmd` every 0.1 s until it succeeds (0) or `seconds` have passed (1)
wait_for() { # seconds cmd...
    local deadline
    deadline=$(( $(date +%s) + $1 ))
    shift
    until "$@"; do
        [ "$(date +%s)" -lt "$deadline" ] || return 1
        sleep 0.1
    done
}
