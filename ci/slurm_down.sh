#!/usr/bin/env bash
# ci/slurm_down.sh - cancel all SLURM jobs and stop slurmd, slurmctld and munged
# started by ci/slurm_up.sh. Safe to run when nothing is running. Leaves the
# packages, /etc/slurm/slurm.conf, the state and the logs in place, so that
# ci/slurm_up.sh can bring the cluster back in a couple of seconds.
set -uo pipefail

CTLD_PID=/run/slurmctld.pid
SLURMD_PID=/run/slurmd.pid
MUNGE_PID=/run/munge/munged.pid
CLEAN_MARKER=/var/spool/slurmctld/clean_shutdown  # read by slurm_up.sh

T0=$(date +%s.%N)
log() { echo "[slurm_down +$(echo "$(date +%s.%N) $T0" | awk '{printf "%.1f", $1 - $2}')s] $*"; }

[ "$(id -u)" -eq 0 ] || { echo "slurm_down.sh must run as root" >&2; exit 1; }

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
stop_pids() { # name pid...: TERM, wait up to 10 s, then KILL
    local name=$1 pid left
    shift
    [ $# -gt 0 ] || return 0
    log "stopping $name (pid $*)"
    kill "$@" 2>/dev/null
    for _ in $(seq 100); do
        left=""
        for pid in "$@"; do running "$pid" && left="$left $pid"; done
        [ -z "$left" ] && return 0
        sleep 0.1
    done
    log "killing $name (pid$left)"
    # shellcheck disable=SC2086
    kill -9 $left 2>/dev/null
}

# 1. cancel all jobs while the controller still answers
if command -v scontrol >/dev/null 2>&1 && timeout 5 scontrol ping 2>/dev/null | grep -q "is UP"; then
    jobs=$(timeout 10 squeue -h -o %A 2>/dev/null | sort -u | tr '\n' ' ')
    if [ -n "${jobs// /}" ]; then
        log "cancelling jobs: $jobs"
        # shellcheck disable=SC2086
        scancel $jobs 2>/dev/null
        for _ in $(seq 60); do
            [ -z "$(timeout 5 squeue -h -o %A 2>/dev/null)" ] && break
            sleep 0.5
        done
        left=$(timeout 5 squeue -h -o %A 2>/dev/null | tr '\n' ' ')
        [ -z "${left// /}" ] || log "jobs still listed after 30 s: $left"
    else
        log "no jobs to cancel"
    fi
    # 2. ask the controller to shut itself and slurmd down
    log "scontrol shutdown"
    timeout 10 scontrol shutdown 2>/dev/null
    for _ in $(seq 100); do
        [ -z "$(pids_of slurmctld)$(pids_of slurmd)" ] && break
        sleep 0.1
    done
    # the controller saved its state on the way out: slurm_up.sh may recover it
    [ -n "$(pids_of slurmctld)" ] || touch "$CLEAN_MARKER"
fi

# 3. whatever is left: by pidfile, else by exact process name
for d in slurmd:"$SLURMD_PID" slurmctld:"$CTLD_PID"; do
    name=${d%%:*}
    if pid=$(alive_pid "${d#*:}" "$name"); then
        stop_pids "$name" "$pid"
    fi
    # shellcheck disable=SC2046
    stop_pids "$name" $(pids_of "$name")
done
# job step daemons (and with them job processes) left behind by a killed slurmd
# shellcheck disable=SC2046
stop_pids slurmstepd $(pids_of slurmstepd)

# 4. munged
if pid=$(alive_pid "$MUNGE_PID" munged); then
    stop_pids munged "$pid"
fi
# shellcheck disable=SC2046
stop_pids munged $(pids_of munged)

log "SLURM stopped"
exit 0
