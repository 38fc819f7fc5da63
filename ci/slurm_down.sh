#!/usr/bin/env bash
# ci/slurm_down.sh - cancel all SLURM jobs and stop slurmd, slurmctld, slurmdbd,
# mariadbd and munged started by ci/slurm_up.sh. Safe to run when nothing is
# running. Leaves the packages, the configuration, the state (slurmctld's and
# the accounting database) and the logs in place, so that ci/slurm_up.sh can
# bring the cluster back in a couple of seconds.
set -uo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
LOG_TAG=slurm_down
# shellcheck source=ci/slurm_lib.sh
. "$SCRIPT_DIR/slurm_lib.sh"

[ "$(id -u)" -eq 0 ] || { echo "slurm_down.sh must run as root" >&2; exit 1; }

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
        stop_pids "$name" 10 "$pid"
    fi
    # shellcheck disable=SC2046
    stop_pids "$name" 10 $(pids_of "$name")
done
# job step daemons (and with them job processes) left behind by a killed slurmd
# shellcheck disable=SC2046
stop_pids slurmstepd 10 $(pids_of slurmstepd)

# 4. the accounting daemon, after slurmctld has sent it its last job records,
# then its database (SIGTERM is mariadbd's clean shutdown; give it time)
if pid=$(alive_pid "$DBD_PID" slurmdbd); then
    stop_pids slurmdbd 10 "$pid"
fi
# shellcheck disable=SC2046
stop_pids slurmdbd 10 $(pids_of slurmdbd)
if pid=$(alive_pid "$MYSQL_PID" mariadbd); then
    stop_pids mariadbd 60 "$pid"
fi
# shellcheck disable=SC2046
stop_pids mariadbd 60 $(pids_of mariadbd)

# 5. munged, used by all of the above
if pid=$(alive_pid "$MUNGE_PID" munged); then
    stop_pids munged 10 "$pid"
fi
# shellcheck disable=SC2046
stop_pids munged 10 $(pids_of munged)

log "SLURM stopped"
exit 0
