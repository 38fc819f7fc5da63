#!/usr/bin/env bash
# ci/slurm_up.sh - turn this machine into a working one-node SLURM cluster.
#
# Usage (as root):  ci/slurm_up.sh      # install, configure, start, smoke-test
#                   ci/slurm_down.sh    # cancel all jobs, stop the daemons
#                   python ci/slurm_check.py   # with a python that has submitit
# The cluster has real accounting, as production clusters do: slurmdbd stores
# every job in Debian's MariaDB (ci/slurm_db.sh), so sacct is /usr/bin/sacct.
# Idempotent: on a machine where it already ran it only checks that munged,
# mariadbd, slurmdbd, slurmctld and slurmd run and answer (starting/restarting
# what is missing, stale or configured differently, re-creating the database
# user or the cluster registration if gone, resuming a down/drained node) and
# redoes the smoke test. Exits non-zero with diagnostics (processes, sinfo,
# scontrol, sacctmgr, log tails of slurmctld/slurmd/slurmdbd/MariaDB/munged)
# when the cluster is not healthy; every wait is bounded. Knobs (env):
# SLURM_CI_CPUS (8), SLURM_CI_PARTITION (train), SLURM_CI_READY_TIMEOUT (60),
# SLURM_CI_SMOKE_TIMEOUT (60), SLURM_CI_DB_TIMEOUT (60).
#
# ============================ NOTES FOR TEST WRITERS ==========================
# Measured on the 2-core / 24 GiB Debian 12 machine, slurm 22.05.8, submitit 1.5.4.
#
# Start-up: fresh machine ~19 s: apt-get install --no-install-recommends of
#   slurm-wlm munge slurmdbd mariadb-server (27 packages, 22 MB) is ~14 s of it
#   (no apt-get update needed when the lists exist), then MariaDB 0.3 s,
#   slurmdbd's first start (creates its tables) ~1 s, the cluster registration
#   ~1-2 s, slurmctld+slurmd ~1 s, smoke tests ~1 s. Packages installed,
#   daemons stopped (after slurm_down.sh): ~3 s. Already running: 1.2-1.8 s
#   (checking the five daemons ~0.7 s, the smoke tests the rest). A killed mariadbd or
#   slurmdbd is restarted in ~1.5 s; slurmctld reconnects to slurmdbd by itself.
#   The daemons detach (own session, parent pid 1) and outlive the script;
#   nothing starts them at boot: run this script again. Changing slurm.conf
#   restarts slurmctld/slurmd cleanly (running jobs survive); only then do
#   commands fail, for ~1-2 s.
# Job start: the scheduler starts a job 0.1-1 s after sbatch (srun hostname
#   takes ~0.1 s, an `sbatch --wrap` job is gone from squeue in ~0.5-0.9 s); a
#   trivial submitit job returns from job.result() in 0.3-2 s.
# Users: jobs run as the submitting user, i.e. root here (DisableRootJobs is
#   off), on node `hostname -s` ("vm"), in the submitter's working directory,
#   with the submitter's whole environment (sbatch --export=ALL default; env vars
#   set in os.environ before executor.submit() are seen by the job) plus
#   SLURM_* vars. submitit runs the job with the submitter's sys.executable, so
#   the job sees the same venv.
# Concurrency: the node advertises max(nproc, 8) = 8 CPUs (CPUs=8 plus
#   SlurmdParameters=config_overrides, so slurmd does not mark the node invalid
#   for having only 2 cores). 8 one-CPU jobs run at once, the 9th waits
#   (squeue reason "Resources") and starts when one ends. Chosen over
#   OverSubscribe=FORCE: no gang-scheduling/sharing semantics, and the CPU
#   count seen by jobs is plain. Nothing is confined (no cgroups:
#   proctrack/linuxproc, task/none): a job may use every core and any memory,
#   --mem is only checked against RealMemory at submission.
# Too big requests are REJECTED at submission (EnforcePartLimits=ALL):
#   slurm_cpus_per_task=32 (the project's default) -> sbatch fails with
#   "More processors requested than permitted" and submitit raises
#   FailedJobError from executor.submit(). Same for > 8 CPUs, > 1 node,
#   --mem above RealMemory, or a partition other than "train". GPUs: none are
#   configured, so slurm_gpus_per_node=1 (the default of torchrl's
#   DEFAULT_SLURM_CONF_MAIN) fails at submission with "Invalid generic resource
#   (gres) specification"; slurm_gpus_per_node=0 is accepted. Without
#   EnforcePartLimits such a job would sit PENDING (PartitionConfig) forever.
# squeue: default columns JOBID PARTITION NAME USER ST TIME NODES
#   NODELIST(REASON); submitit jobs are named "submitit"; states PD, R, CG
#   (completing, e.g. ~5 s after scancel of a submitit job). Finished jobs
#   leave squeue at once (`squeue -t all` / `scontrol show job` keep them 10 min).
# scancel ID: returns at once with rc 0 (also for unknown or finished ids). The
#   job gets SIGCONT+SIGTERM, then SIGKILL after KillWait=5 s. Plain processes
#   die at once (job gone from squeue in ~0.2 s); submitit's job process
#   ignores SIGTERM ("Bypassing signal SIGTERM"), so a cancelled submitit job
#   stays in squeue as CG and its processes live ~5 s more (until SIGKILL),
#   although sacct says CANCELLED at once. slurm_down.sh cancels everything.
# sacct (real, /usr/bin/sacct; the accounting database keeps jobs forever, and
#   `sacct -j ID` searches all time):
#   * A new job is unknown to sacct (no row; submitit's job.state "UNKNOWN")
#     until slurmctld's db-index thread records it -- it runs every 5 s, not
#     configurable -- or the job starts: measured 0.1-5 s after sbatch.
#   * RUNNING lags: sacct says PENDING for 0.5-5 s after squeue says RUNNING
#     (until that thread's next pass); a job shorter than that may go from
#     PENDING (or no row) straight to COMPLETED. Do not wait for RUNNING in
#     sacct to know that a job started: wait for what the job does.
#   * End states are prompt: COMPLETED, FAILED (non-zero exit), TIMEOUT and
#     "CANCELLED by 0" (uid of the canceller) show within ~0.2 s of the job
#     leaving squeue, CANCELLED within ~0.2 s of the scancel itself. Only a job
#     that ends before sacct ever saw it can wait the 0-5 s above to appear.
#   * Through submitit: job.get_info(mode="force") / watcher.get_state(id,
#     mode="force") run sacct now; job.state is submitit's cache, refreshed
#     at most every max(2 s, age/2), so it trails by seconds. Measured for a
#     submitit job: result() of a trivial job at ~1 s, sacct COMPLETED ~0.2 s
#     later (the result file is written before the job ends); a function that
#     raises: done(force_check=True) and FAILED at its end, or up to ~5 s
#     after submission if sacct had not seen it yet.
#   * rlharvest's SlurmNode reads these states: PENDING/RUNNING/UNKNOWN count
#     as alive; a node job scancelled during collection is reported as
#     "SLURM job N is CANCELLED" when its processes die (KillWait, ~5 s).
#   * Earlier versions of this script put a shim at /usr/local/bin/sacct
#     (there was no database then); this version removes it.
# submitit pitfalls:
#   * --signal=USR2@90 is submitit's default (slurm_signal_delay_s=90). SLURM
#     sends that signal once "time left <= 90 s + 30 s", checked every 30 s, so
#     with timeout_min=1 the job gets USR2 0-30 s after it starts, and for a
#     timeout under 10 min submitit always treats USR2 as "timed out": the job
#     fails with UncompletedJobError "timed-out and not checkpointable"
#     (measured: a 45 s job with timeout_min=1 failed after 24 s). With
#     timeout_min=1 pass slurm_signal_delay_s=0 (no signal at all), or use
#     timeout_min >= 3 for jobs shorter than a minute.
#   * Time limits are enforced on a 30 s tick: a timeout_min=1 job is killed
#     60-90 s after its start (measured 76 s and 79 s until done; sacct says
#     TIMEOUT as soon as it is gone from squeue).
#   * job.result() of a job that left no result file (cancelled, timed out)
#     first waits job._results_timeout_s = 15 s for that file, then raises
#     UncompletedJobError.
#   * Normal completion is seen within ~1 s (result file polled every second);
#     failures without a result file are seen at the next sacct poll, which
#     submitit spaces out (2 s, then half the time since the last submission,
#     up to 10 min): use job.done(force_check=True) in bounded wait loops.
#   * Job ids keep growing across restarts: after a clean stop (slurm_down.sh)
#     slurmctld recovers its state; after a crash/kill it is cold-started
#     (stale jobs discarded) with FirstJobId = highest id in its logs or in
#     the accounting database + 1 (sacct -j must never find two jobs).
#     Still, prefer a fresh submitit folder per test (tmp_path): torchrl's
#     collectors use AutoExecutor(folder="log_test"), relative to the cwd.
# Addresses: the job runs on this same machine, in the same network namespace.
#   `hostname -I` prints "192.0.2.2 fd00::2" here (first word = the IPv4
#   address); jobs can also reach the submitter on 127.0.0.1, which is what
#   slurm_check.py uses (this workplace wants test traffic kept on loopback).
#   Note socket.gethostbyname(socket.gethostname()) -- what torchrl's
#   collectors use for MASTER_ADDR -- gives 127.0.0.1 here (/etc/hosts maps
#   "vm" to 127.0.0.1), which works on this one-node cluster.
# Logs: /var/log/slurm/{slurmctld,slurmd,slurmdbd}.log, job completions in
#   /var/log/slurm/jobcomp.log, MariaDB in /var/log/mysql/error.log, munged in
#   /var/log/munge/munged.log. Harmless noise there: "mpi/pmix_v4 ... can not
#   load PMIx library" errors. MariaDB (data in /var/lib/mysql) has no TCP
#   port (skip-networking): `mariadb -uroot` as root reaches it on its socket.
# ==============================================================================
set -euo pipefail

PARTITION="${SLURM_CI_PARTITION:-train}"
MIN_CPUS="${SLURM_CI_CPUS:-8}"          # CPUs advertised to slurm (at least nproc)
READY_TIMEOUT="${SLURM_CI_READY_TIMEOUT:-60}"
SMOKE_TIMEOUT="${SLURM_CI_SMOKE_TIMEOUT:-60}"
CLUSTER=ci

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
LOG_TAG=slurm_up
# shellcheck source=ci/slurm_lib.sh
. "$SCRIPT_DIR/slurm_lib.sh"
# shellcheck source=ci/slurm_db.sh
. "$SCRIPT_DIR/slurm_db.sh"

die() {
    echo "[slurm_up +$(elapsed)s] ERROR: $*" >&2
    diagnostics >&2 || true
    exit 1
}
diagnostics() {
    echo "----- diagnostics -----"
    echo "## processes"
    # shellcheck disable=SC2009  # want full command lines of all related processes
    ps -eo pid,user,stat,etime,args | grep -E '[m]unged|[s]lurm|[m]ariadbd' || true
    echo "## munge -n | unmunge"; (munge -n | unmunge) 2>&1 | head -5 || true
    echo "## scontrol ping"; timeout 10 scontrol ping 2>&1 || true
    echo "## sinfo"; timeout 10 sinfo -N -l 2>&1 || true
    echo "## squeue"; timeout 10 squeue 2>&1 || true
    echo "## scontrol show node"; timeout 10 scontrol show node 2>&1 || true
    db_diagnostics
    for f in "$LOG_DIR/slurmctld.log" "$LOG_DIR/slurmd.log" /var/log/munge/munged.log; do
        echo "## tail $f"; tail -n 30 "$f" 2>&1 || true
    done
    echo "-----------------------"
}
[ "$(id -u)" -eq 0 ] || { echo "slurm_up.sh must run as root" >&2; exit 1; }
export DEBIAN_FRONTEND=noninteractive

# ---------------------------------------------------------------- 1. packages
missing_pkgs() { # package...: those not installed
    local p
    for p in "$@"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || echo "$p"
    done
}
apt_install() { # apt-get option... package...
    local opts=(-y -q -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold)
    log "installing $* (apt-get)"
    if ! apt-get install "${opts[@]}" "$@" >>/tmp/slurm_up.apt.log 2>&1; then
        log "apt-get install failed, running apt-get update and retrying"
        apt-get update -q >>/tmp/slurm_up.apt.log 2>&1 || true
        apt-get install "${opts[@]}" "$@" >>/tmp/slurm_up.apt.log 2>&1 \
            || { tail -n 30 /tmp/slurm_up.apt.log >&2; die "apt-get install $* failed"; }
    fi
}
PKGS=(slurm-wlm slurmctld slurmd slurm-client munge slurmdbd slurm-wlm-mysql-plugin mariadb-server)
if [ -z "$(missing_pkgs "${PKGS[@]}")" ]; then
    log "slurm-wlm, munge, slurmdbd and mariadb-server already installed"
else
    : >/tmp/slurm_up.apt.log
    # No recommends: they are slurm plugins this configuration does not load
    # (hdf5/influxdb profiling, jwt, elasticsearch, rrd, ipmi, rsmi), their
    # -dev packages, and MariaDB's perl CGI modules and compression providers.
    apt_install --no-install-recommends slurm-wlm munge slurmdbd mariadb-server
    [ -z "$(missing_pkgs "${PKGS[@]}")" ] \
        || die "packages still not installed after apt-get: $(missing_pkgs "${PKGS[@]}" | tr '\n' ' ')"
    log "packages installed"
fi

# ------------------------------------------------------------------- 2. munge
install -d -o munge -g munge -m 0700 /etc/munge /var/log/munge
install -d -o munge -g munge -m 0711 /var/lib/munge
install -d -o munge -g munge -m 0755 /run/munge
if [ ! -s "$MUNGE_KEY" ]; then
    log "creating munge key"
    if command -v mungekey >/dev/null 2>&1; then
        mungekey --create --keyfile="$MUNGE_KEY" --force
    else
        dd if=/dev/urandom of="$MUNGE_KEY" bs=1024 count=1 status=none
    fi
fi
chown munge:munge "$MUNGE_KEY"
chmod 0400 "$MUNGE_KEY"

munge_ok() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }
if munge_ok; then
    log "munged already running"
else
    if pid=$(alive_pid "$MUNGE_PID" munged); then
        log "munged (pid $pid) is not answering, restarting it"
        kill "$pid" 2>/dev/null || true
        sleep 1
    fi
    log "starting munged"
    # munged forks and detaches (setsid) by itself; --force removes a stale socket.
    runuser -u munge -- /usr/sbin/munged --force \
        || die "munged failed to start"
    for _ in $(seq 50); do munge_ok && break; sleep 0.1; done
    munge_ok || die "munge -n | unmunge does not work"
fi
log "munge OK"

# -------------------------------------------------------------- 3. slurm.conf
HOST=$(hostname -s)
NPROC=$(nproc)
CPUS=$(( NPROC > MIN_CPUS ? NPROC : MIN_CPUS ))
MEM_MB=$(awk '/^MemTotal:/ {print int($2 / 1024)}' /proc/meminfo)
MARGIN=$(( MEM_MB / 10 > 512 ? MEM_MB / 10 : 512 ))
REAL_MEM=$(( MEM_MB - MARGIN ))
[ "$REAL_MEM" -gt 0 ] || REAL_MEM=1

install -d -m 0755 "$CONF_DIR" "$LOG_DIR" "$STATE_DIR" "$SPOOL_DIR"

NEW_CONF=$(mktemp)
trap 'rm -f "$NEW_CONF"' EXIT
cat >"$NEW_CONF" <<EOF
# Written by ci/slurm_up.sh - single-node CI cluster. Do not edit by hand.
ClusterName=ci
SlurmctldHost=${HOST}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CryptoType=crypto/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
ReturnToService=2
StateSaveLocation=${STATE_DIR}
SlurmdSpoolDir=${SPOOL_DIR}
SlurmctldPidFile=${CTLD_PID}
SlurmdPidFile=${SLURMD_PID}
SlurmctldLogFile=${LOG_DIR}/slurmctld.log
SlurmdLogFile=${LOG_DIR}/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
MailProg=/bin/true
EnforcePartLimits=ALL
# scheduling: start jobs within a second or two of submission
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=1,batch_sched_delay=0,sched_min_interval=0
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# advertise ${CPUS} CPUs even if the machine has fewer (nproc=${NPROC}) so that
# several 1-CPU jobs run at once; config_overrides keeps the node valid.
SlurmdParameters=config_overrides
# timers: fast kill on scancel/timeout, keep finished jobs visible for 10 min
KillWait=5
MinJobAge=600
InactiveLimit=0
Waittime=0
MessageTimeout=10
SlurmctldTimeout=60
SlurmdTimeout=60
# accounting: slurmdbd (MariaDB behind it) records every job, so sacct
# answers as on a production cluster; the completion log is kept as well
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=${DBD_PORT}
JobAcctGatherType=jobacct_gather/linux
JobCompType=jobcomp/filetxt
JobCompLoc=${LOG_DIR}/jobcomp.log
# node and partition
NodeName=${HOST} NodeAddr=127.0.0.1 CPUs=${CPUS} RealMemory=${REAL_MEM} State=UNKNOWN
PartitionName=${PARTITION} Nodes=${HOST} Default=YES MaxTime=INFINITE State=UP
EOF

# A FirstJobId= line is appended at cold starts only (see below); it is not
# part of the comparison.
write_conf() { # [FirstJobId]
    local first=${1:-}
    [ -n "$first" ] || first=$(grep -h '^FirstJobId=' "$CONF" 2>/dev/null | tail -n1 | cut -d= -f2 || true)
    { cat "$NEW_CONF"; [ -z "$first" ] || echo "FirstJobId=$first"; } >"$CONF.tmp"
    chmod 0644 "$CONF.tmp"
    mv -f "$CONF.tmp" "$CONF"
}
CONF_CHANGED=0
if [ -f "$CONF" ] && grep -v '^FirstJobId=' "$CONF" | cmp -s "$NEW_CONF" -; then
    log "slurm.conf unchanged (NodeName=$HOST CPUs=$CPUS RealMemory=$REAL_MEM)"
else
    CONF_CHANGED=1
    write_conf
    log "wrote $CONF (NodeName=$HOST CPUs=$CPUS RealMemory=$REAL_MEM)"
fi

touch "$LOG_DIR/jobcomp.log"

db_write_configs

# ------------------------------------------------- 4. accounting: MariaDB, slurmdbd
# before slurmctld, so that its first job records find the database
mariadb_up
slurmdbd_up

# ---------------------------------------------------------------- 5. slurm daemons
if [ "$CONF_CHANGED" = 1 ]; then
    for pf in "$SLURMD_PID:slurmd" "$CTLD_PID:slurmctld"; do
        if pid=$(alive_pid "${pf%%:*}" "${pf##*:}"); then
            if stop_pids "${pf##*:} (slurm.conf changed)" 10 "$pid" && [ "${pf##*:}" = slurmctld ]; then touch "$CLEAN_MARKER"; fi
        fi
    done
fi

CTLD_STARTED=0
if pid=$(alive_pid "$CTLD_PID" slurmctld); then
    log "slurmctld already running (pid $pid)"
else
    CTLD_STARTED=1
    if [ -f "$CLEAN_MARKER" ]; then
        # stopped cleanly (slurm_down.sh or a config change): recover its state
        log "starting slurmctld"
        rm -f "$CLEAN_MARKER"
        slurmctld -L "$LOG_DIR/slurmctld.log" || die "slurmctld failed to start"
    else
        # first start, or the controller was killed: its saved state may be
        # stale (finished jobs shown RUNNING, job ids reused), so start clean
        # Job ids would restart at 1; continue after the highest id ever used
        # here instead (logs and accounting database), so that submitit
        # folders keyed by job id never meet files of an older job with the
        # same id, and `sacct -j ID` (all time by default) never finds two.
        # (only lines where slurmctld creates/starts/ends a job: a kill RPC
        # for a mistyped id must not count; array tasks read "JobId=9_1(11)")
        last_id=$( { grep -o '^JobId=[0-9]*' "$LOG_DIR/jobcomp.log" 2>/dev/null
                     echo "JobId=$(db_max_job_id)"
                     grep -E 'submit_batch_job|allocate_resources|sched: Allocate|_start_job|_job_complete' \
                         "$LOG_DIR/slurmctld.log" 2>/dev/null | grep -oE 'JobId=[0-9]+|\([0-9]+\)'
                   } | tr -dc '0-9\n' | sort -n | tail -n1 || true)
        first_id=$(( ${last_id:-0} + 1 ))
        write_conf "$first_id"
        log "starting slurmctld (cold start: no clean shutdown recorded, old jobs discarded; FirstJobId=$first_id)"
        slurmctld -c -L "$LOG_DIR/slurmctld.log" || die "slurmctld failed to start"
    fi
fi
# wait for the controller to answer before starting slurmd
for _ in $(seq 100); do
    timeout 5 scontrol ping 2>/dev/null | grep -q "is UP" && break
    sleep 0.2
done
timeout 5 scontrol ping 2>/dev/null | grep -q "is UP" || die "slurmctld does not answer scontrol ping"

SLURMD_STARTED=0
if [ "$CTLD_STARTED" = 1 ] && pid=$(alive_pid "$SLURMD_PID" slurmd); then
    # a fresh controller: restart slurmd too so that it registers right away
    log "restarting slurmd (pid $pid) for the new slurmctld"
    stop_pids slurmd 10 "$pid" || true
fi
if pid=$(alive_pid "$SLURMD_PID" slurmd); then
    log "slurmd already running (pid $pid)"
else
    log "starting slurmd"
    SLURMD_STARTED=$(date +%s)
    slurmd -L "$LOG_DIR/slurmd.log" || die "slurmd failed to start"
fi
# has slurmd registered with the controller since we started it?
slurmd_registered() {
    [ "$SLURMD_STARTED" = 0 ] && return 0
    local t
    t=$(timeout 5 scontrol show node "$HOST" -o 2>/dev/null | grep -o 'SlurmdStartTime=[^ ]*' | cut -d= -f2)
    [ -n "$t" ] && [ "$t" != None ] && [ "$(date -d "$t" +%s 2>/dev/null || echo 0)" -ge $(( SLURMD_STARTED - 1 )) ]
}

# wait until the node is usable; resume it if down/drained
deadline=$(( $(date +%s) + READY_TIMEOUT ))
resumed=0
while :; do
    state=$(timeout 5 sinfo -h -n "$HOST" -o '%T' 2>/dev/null | head -n1 || true)
    case "$state" in
        idle|mixed|allocated|completing) slurmd_registered && break ;;
        down|down~|drained|draining|drain|fail|failing)
            # responding but down/drained (no '*'): left over from an earlier run
            if [ "$resumed" -lt 3 ]; then
                log "node $HOST is '$state', resuming it"
                scontrol update NodeName="$HOST" State=RESUME 2>&1 || true
                resumed=$(( resumed + 1 ))
            fi ;;
    esac
    [ "$(date +%s)" -lt "$deadline" ] || die "node $HOST not idle after ${READY_TIMEOUT}s (state '$state')"
    sleep 0.5
done
log "node $HOST is $state in partition $PARTITION"

# the sacct shim of earlier versions of this script would hide the real sacct
if [ -f "$OLD_SACCT_SHIM" ] && grep -q "installed by ci/slurm_up.sh" "$OLD_SACCT_SHIM"; then
    rm -f "$OLD_SACCT_SHIM"
    hash -r
    log "removed the old sacct shim $OLD_SACCT_SHIM"
fi
[ "$(type -P sacct)" = /usr/bin/sacct ] || log "WARNING: sacct in PATH is $(type -P sacct), not /usr/bin/sacct"

# ------------------------------------------------------------ 6. smoke test
SMOKE_OUT=$(mktemp /tmp/slurm_smoke.XXXXXX)
SMOKE_ERR=$(mktemp /tmp/slurm_smoke.XXXXXX)
t=$(date +%s.%N)
timeout "$SMOKE_TIMEOUT" srun -p "$PARTITION" -N1 -n1 -c1 -t 1 hostname >"$SMOKE_OUT" 2>"$SMOKE_ERR" \
    || { cat "$SMOKE_OUT" "$SMOKE_ERR" >&2; die "srun smoke test failed"; }
log "srun hostname -> '$(tr -d '\n' <"$SMOKE_OUT")' in $(echo "$(date +%s.%N) $t" | awk '{printf "%.2f", $1-$2}')s"
[ ! -s "$SMOKE_ERR" ] || { log "srun said:"; cat "$SMOKE_ERR"; }
rm -f "$SMOKE_ERR"

t=$(date +%s.%N)
# shellcheck disable=SC2016  # expanded inside the job
jobid=$(sbatch --parsable -p "$PARTITION" -N1 -n1 -c1 -t 1 -J smoke -o "$SMOKE_OUT" \
    --wrap 'echo "ok $(hostname) $SLURM_JOB_ID"') || die "sbatch smoke test failed to submit"
jobid=${jobid%%;*}
deadline=$(( $(date +%s) + SMOKE_TIMEOUT ))
while [ -n "$(squeue -h -j "$jobid" -o %i 2>/dev/null)" ]; do
    [ "$(date +%s)" -lt "$deadline" ] || { scancel "$jobid" || true; die "sbatch job $jobid did not finish in ${SMOKE_TIMEOUT}s"; }
    sleep 0.2
done
grep -q "^ok .* $jobid\$" "$SMOKE_OUT" || { cat "$SMOKE_OUT" >&2; die "sbatch job $jobid produced unexpected output"; }
log "sbatch job $jobid finished in $(echo "$(date +%s.%N) $t" | awk '{printf "%.2f", $1-$2}')s"
rm -f "$SMOKE_OUT"

# the job's record went slurmctld -> slurmdbd -> MariaDB and back through sacct
sacct_completed() { [ "$(sacct -n -X -P -o State -j "$jobid" 2>/dev/null)" = COMPLETED ]; }
wait_for "$SMOKE_TIMEOUT" sacct_completed \
    || die "sacct does not show job $jobid COMPLETED after ${SMOKE_TIMEOUT}s: '$(sacct -n -X -P -o State -j "$jobid" 2>&1)'"
log "sacct: job $jobid COMPLETED $(echo "$(date +%s.%N) $t" | awk '{printf "%.2f", $1-$2}')s after its submission"

log "SLURM cluster ready: node $HOST ($CPUS CPUs), partition $PARTITION; IP for jobs: $(hostname -I | awk '{print $1}')"
log "total time $(elapsed)s"
