#!/usr/bin/env bash
# sacct shim installed by ci/slurm_up.sh as /usr/local/bin/sacct (ahead of
# /usr/bin/sacct in PATH).
#
# The CI cluster has no accounting database (AccountingStorageType=none), so the
# real sacct only prints "Slurm accounting storage is disabled" and exits 1.
# submitit polls `sacct -o JobID,State,NodeList --parsable2 -j ID ...` to learn
# job states; without an answer every state stays UNKNOWN and a job that ends
# without writing its result file (scancel, time limit, killed) is never seen
# as done, so job.wait()/job.result() would hang.
#
# This shim runs the real sacct first and passes its answer through when it
# works (a real accounting database configured). Otherwise it answers itself:
#   - finished jobs from the job completion log (JobCompType=jobcomp/filetxt),
#     one row per record, with array tasks shown as ARRAYID_TASKID like sacct
#     does (`sacct -c` cannot do that: it does not know array fields);
#   - pending/running/completing jobs from squeue, printed after the finished
#     ones, so that for a requeued job the current state is the last row.
# Understood options: -o/--format (fields below, an optional %WIDTH suffix),
# -j/--jobs (repeatable, comma lists; a job id selects all its array tasks),
# -p/--parsable, -P/--parsable2, -n/--noheader, --delimiter. Other options
# (time window, users, states, -X, -a, ...) are accepted and ignored: all jobs
# known are listed, and job steps are never listed.
REAL=/usr/bin/sacct
JOBCOMP=/var/log/slurm/jobcomp.log

err=$(mktemp)
sq=$(mktemp)
trap 'rm -f "$err" "$sq"' EXIT
out=$("$REAL" "$@" 2>"$err")
rc=$?
if [ "$rc" -eq 0 ] || ! grep -qi "accounting storage is disabled" "$err"; then
    cat "$err" >&2
    [ -z "$out" ] || printf '%s\n' "$out"
    exit "$rc"
fi

fields="JobID,JobName,Partition,Account,AllocCPUS,State,ExitCode"
jobs=""
parsable=0
noheader=0
delim="|"
args=("$@")
i=0
while [ "$i" -lt "${#args[@]}" ]; do
    a=${args[$i]}
    case "$a" in
        -o|--format) i=$((i + 1)); fields=${args[$i]:-$fields} ;;
        -o*) fields=${a#-o} ;;
        --format=*) fields=${a#--format=} ;;
        -j|--jobs) i=$((i + 1)); jobs="$jobs,${args[$i]:-}" ;;
        -j*) jobs="$jobs,${a#-j}" ;;
        --jobs=*) jobs="$jobs,${a#--jobs=}" ;;
        -P|--parsable2) parsable=2 ;;
        -p|--parsable) parsable=1 ;;
        -n|--noheader) noheader=1 ;;
        --delimiter=*) delim=${a#--delimiter=} ;;
        --delimiter) i=$((i + 1)); delim=${args[$i]:-|} ;;
        -*)
            # bundled boolean short flags such as -nP or -XP
            if [[ "$a" =~ ^-[aDlLnpPTX]+$ ]]; then
                case "$a" in *P*) parsable=2 ;; *p*) parsable=1 ;; esac
                case "$a" in *n*) noheader=1 ;; esac
            fi ;;
    esac
    i=$((i + 1))
done

squeue -h -o '%A|%i|%T|%N|%j|%P|%u|%U|%g|%a|%M|%S|%V|%e|%l|%D|%C|%r|%Z|%Q|%q' >"$sq" 2>/dev/null
[ -f "$JOBCOMP" ] || JOBCOMP=/dev/null

awk -v fields="$fields" -v want="${jobs#,}" -v parsable="$parsable" \
    -v noheader="$noheader" -v delim="$delim" -v sqfile="$sq" '
function selected(raw, id, base) {
    if (nsel == 0) return 1
    return (raw in sel) || (id in sel) || (base in sel)
}
function emit(   k, line, v, w) {
    line = ""
    for (k = 1; k <= nf; k++) {
        v = (fname[k] in val) ? val[fname[k]] : ""
        if (parsable) line = line (k > 1 ? delim : "") v
        else {
            w = width[k]
            if (length(v) > w) v = substr(v, 1, w - 1) "+"
            line = line (k > 1 ? " " : "") sprintf(k == 1 ? "%-" w "s" : "%" w "s", v)
        }
    }
    if (parsable == 1) line = line delim
    print line
}
BEGIN {
    nsel = split(want, w, ",")
    for (k = 1; k <= nsel; k++) if (w[k] != "") sel[w[k]] = 1
    nf = split(fields, f, ",")
    for (k = 1; k <= nf; k++) {
        name = f[k]; width[k] = 10
        if (name ~ /%/) { width[k] = substr(name, index(name, "%") + 1) + 0; name = substr(name, 1, index(name, "%") - 1) }
        else if (tolower(name) == "jobid" || tolower(name) == "jobidraw") width[k] = 12
        else if (tolower(name) == "nodelist") width[k] = 15
        else if (tolower(name) ~ /^(start|end|submit|eligible)$/) width[k] = 19
        header[k] = name; fname[k] = tolower(name)
    }
    if (!noheader) {
        line = ""; dash = ""
        for (k = 1; k <= nf; k++) {
            if (parsable) line = line (k > 1 ? delim : "") header[k]
            else {
                line = line (k > 1 ? " " : "") sprintf((k == 1 ? "%-" : "%") width[k] "s", substr(header[k], 1, width[k]))
                d = ""; for (j = 0; j < width[k]; j++) d = d "-"
                dash = dash (k > 1 ? " " : "") d
            }
        }
        if (parsable == 1) line = line delim
        print line
        if (!parsable) print dash
    }
}
# job completion records: Key=Value Key=Value ... (values may contain spaces)
FILENAME != sqfile {
    delete rec; key = ""
    for (k = 1; k <= NF; k++) {
        if (match($k, /^[A-Za-z]+=/)) { key = substr($k, 1, RLENGTH - 1); rec[key] = substr($k, RLENGTH + 1) }
        else if (key != "") rec[key] = rec[key] " " $k
    }
    raw = rec["JobId"]; id = raw; base = raw
    if (("ArrayJobId" in rec) && rec["ArrayJobId"] != "") { base = rec["ArrayJobId"]; id = base "_" rec["ArrayTaskId"] }
    if (!selected(raw, id, base)) next
    delete val
    user = rec["UserId"]; uid = user; sub(/\(.*/, "", user); gsub(/.*\(|\).*/, "", uid)
    group = rec["GroupId"]; sub(/\(.*/, "", group)
    val["jobid"] = id; val["jobidraw"] = raw; val["state"] = rec["JobState"]
    val["nodelist"] = rec["NodeList"]; val["jobname"] = rec["Name"]; val["partition"] = rec["Partition"]
    val["user"] = user; val["uid"] = uid; val["group"] = group; val["account"] = rec["Account"]
    val["start"] = rec["StartTime"]; val["end"] = rec["EndTime"]; val["submit"] = rec["SubmitTime"]
    val["eligible"] = rec["EligibleTime"]; val["timelimit"] = rec["TimeLimit"]
    val["nnodes"] = rec["NodeCnt"]; val["alloccpus"] = rec["ProcCnt"]; val["ncpus"] = rec["ProcCnt"]
    val["reqcpus"] = rec["ProcCnt"]; val["workdir"] = rec["WorkDir"]; val["exitcode"] = rec["ExitCode"]
    val["derivedexitcode"] = rec["DerivedExitCode"]; val["qos"] = rec["QOS"]; val["cluster"] = "ci"
    val["wckey"] = rec["WcKey"]; val["reason"] = "None"
    emit()
    next
}
# active jobs from squeue: %A|%i|%T|%N|%j|%P|%u|%U|%g|%a|%M|%S|%V|%e|%l|%D|%C|%r|%Z|%Q|%q
{
    n = split($0, q, "|")
    raw = q[1]; id = q[2]; base = id; sub(/_.*/, "", base)
    if (!selected(raw, id, base)) next
    delete val
    val["jobidraw"] = raw; val["jobid"] = id; val["state"] = q[3]; val["nodelist"] = (q[4] == "" ? "None assigned" : q[4])
    val["jobname"] = q[5]; val["partition"] = q[6]; val["user"] = q[7]; val["uid"] = q[8]; val["group"] = q[9]
    val["account"] = (q[10] == "(null)" ? "" : q[10]); val["elapsed"] = q[11]; val["start"] = q[12]; val["submit"] = q[13]; val["end"] = q[14]
    val["timelimit"] = q[15]; val["nnodes"] = q[16]; val["alloccpus"] = q[17]; val["ncpus"] = q[17]
    val["reqcpus"] = q[17]; val["reason"] = q[18]; val["workdir"] = q[19]; val["priority"] = q[20]
    val["qos"] = q[21]; val["exitcode"] = "0:0"; val["derivedexitcode"] = "0:0"; val["cluster"] = "ci"
    emit()
}
' "$JOBCOMP" "$sq"
exit 0
