#!/usr/bin/env python3
"""Check that submitit can run real jobs on the local SLURM cluster.

Run with a python that has submitit installed (e.g. the project's venv), after
ci/slurm_up.sh:

    python ci/slurm_check.py

Takes no arguments, prints what it checks with timings, exits 0 on success and
1 on the first failure. Jobs and their logs go to a fresh folder under /tmp,
which is removed on success. Takes about 15 s.

What it checks:
  1. AutoExecutor picks the "slurm" cluster, and sacct in PATH is the real
     program (the accounting database answers it, no shim in front).
  2. A job returns its result through job.result(); it ran with the same python
     executable, the submitter's working directory and environment, as the same
     user, with SLURM_JOB_ID set, and could reach a TCP server of the
     submitting process (on 127.0.0.1).
  3. Three 1-CPU jobs run at the same time (a file barrier that only passes
     if all three are running together).
  4. A job asking for more CPUs than the node has is rejected at submission.
  5. sacct reports the finished job of 2 as COMPLETED, a running job as
     RUNNING, a cancelled job as done with state CANCELLED, and a job whose
     function raised as FAILED (submitit reads them all through sacct, i.e.
     slurmctld -> slurmdbd -> MariaDB).
"""
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
import uuid

PARTITION = "train"
T0 = time.time()


def log(msg):
    print(f"[slurm_check +{time.time() - T0:5.1f}s] {msg}", flush=True)


def fail(msg):
    log(f"FAILED: {msg}")
    sys.exit(1)


def wait_state(job, expected, timeout, what):
    """Wait until sacct reports ``expected`` (a prefix: "CANCELLED by 0")."""
    deadline = time.time() + timeout
    state = ""
    while not state.startswith(expected):
        if time.time() > deadline:
            fail(f"{what}: sacct says {state!r} for job {job.job_id} after {timeout}s, expected {expected}; "
                 "is slurmdbd running (ci/slurm_up.sh)?")
        time.sleep(0.1)
        state = job.get_info(mode="force").get("State", "")
    return state


def boom():
    # runs inside the SLURM job
    raise ValueError("raised on purpose by slurm_check.py")


def wait_done(job, timeout, what):
    deadline = time.time() + timeout
    while not job.done(force_check=True):
        if time.time() > deadline:
            fail(f"{what}: job {job.job_id} not done after {timeout}s (state {job.state})")
        time.sleep(0.25)


def job_info(port, token_name):
    # runs inside the SLURM job
    import getpass
    import os
    import socket
    import sys

    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"hello from job " + os.environ.get("SLURM_JOB_ID", "?").encode())
    return {
        "executable": sys.executable,
        "cwd": os.getcwd(),
        "token": os.environ.get(token_name),
        "uid": os.getuid(),
        "user": getpass.getuser(),
        "hostname": socket.gethostname(),
        "job_id": os.environ.get("SLURM_JOB_ID"),
        "cpus": os.environ.get("SLURM_CPUS_PER_TASK"),
    }


def barrier(folder, name, n, timeout):
    # runs inside the SLURM job: passes only if n jobs run at the same time
    import os
    import time

    open(os.path.join(folder, f"{name}.started"), "w").close()
    deadline = time.time() + timeout
    while time.time() < deadline:
        started = [f for f in os.listdir(folder) if f.endswith(".started")]
        if len(started) >= n:
            return len(started)
        time.sleep(0.1)
    raise RuntimeError(f"only {len(started)} of {n} jobs running together")


def sleeper(seconds):
    import time

    time.sleep(seconds)
    return "not cancelled"


def main():
    try:
        import submitit
    except ImportError:
        fail(f"submitit is not importable by {sys.executable}")
    if shutil.which("sbatch") is None:
        fail("sbatch not in PATH: run ci/slurm_up.sh first")
    sacct = shutil.which("sacct")
    with open(sacct, "rb") as f:
        if f.read(4) != b"\x7fELF":
            fail(f"sacct in PATH is {sacct}, a script, not the real program: run ci/slurm_up.sh")

    folder = tempfile.mkdtemp(prefix="slurm_check_", dir="/tmp")
    log(f"python {sys.executable}, submitit {submitit.__version__}, folder {folder}")

    executor = submitit.AutoExecutor(folder=os.path.join(folder, "%j"))
    if executor.cluster != "slurm":
        fail(f"AutoExecutor picked cluster {executor.cluster!r}, not 'slurm'")
    # slurm_signal_delay_s=0: submitit's default (--signal=USR2@90) is longer
    # than a 1-minute time limit, so SLURM would send USR2 at its first periodic
    # check (0-30 s into the job) and submitit would end the job with
    # UncompletedJobError. See the notes at the top of ci/slurm_up.sh.
    executor.update_parameters(
        timeout_min=1, slurm_partition=PARTITION, slurm_cpus_per_task=1, slurm_signal_delay_s=0
    )

    # --- 2. one job, result, environment
    token_name = "SLURM_CHECK_TOKEN"
    token = uuid.uuid4().hex
    os.environ[token_name] = token
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(60)
    received = []

    def accept():
        try:
            conn, _ = server.accept()
            with conn:
                received.append(conn.recv(100).decode())
        except OSError as e:
            received.append(f"error: {e}")

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    t = time.time()
    job = executor.submit(job_info, server.getsockname()[1], token_name)
    log(f"submitted job {job.job_id} in {time.time() - t:.2f}s")
    wait_done(job, 60, "basic job")
    info = job.result()
    log(f"job {job.job_id} result after {time.time() - t:.2f}s: {info}")
    thread.join(5)
    server.close()
    expected = {
        "executable": sys.executable,
        "cwd": os.getcwd(),
        "token": token,
        "uid": os.getuid(),
        "job_id": job.job_id,
        "cpus": "1",
    }
    for key, value in expected.items():
        if info[key] != value:
            fail(f"job saw {key}={info[key]!r}, expected {value!r}")
    if not received or not received[0].startswith("hello from job"):
        fail(f"job did not reach the submitter's TCP server: {received}")
    log(f"job ran as {info['user']} on {info['hostname']}, same python/cwd/env, TCP back OK")
    # the result file is written before the job ends: sacct may still say RUNNING (or PENDING) for a moment
    state = wait_state(job, "COMPLETED", 30, "basic job")
    log(f"sacct (via submitit) says state={state} {time.time() - t:.2f}s after the submission")

    # --- 3. concurrency
    n = 3
    bfolder = os.path.join(folder, "barrier")
    os.makedirs(bfolder)
    t = time.time()
    jobs = [executor.submit(barrier, bfolder, f"j{i}", n, 30) for i in range(n)]
    for j in jobs:
        wait_done(j, 60, "concurrent jobs")
    results = [j.result() for j in jobs]
    log(f"{n} concurrent 1-CPU jobs {[j.job_id for j in jobs]} all ran together in {time.time() - t:.2f}s: {results}")

    # --- 4. too many CPUs is rejected at submission
    big = submitit.AutoExecutor(folder=os.path.join(folder, "%j"))
    big.update_parameters(timeout_min=1, slurm_partition=PARTITION, slurm_cpus_per_task=32)
    try:
        j = big.submit(sleeper, 0)
    except Exception as e:  # submitit raises on sbatch failure
        msg = str(e).strip().splitlines()
        log(f"slurm_cpus_per_task=32 rejected at submission: {type(e).__name__}: {msg[-1] if msg else ''}")
    else:
        j.cancel(check=False)
        fail(f"job {j.job_id} asking 32 CPUs was accepted")

    # --- 5. state and cancel
    t = time.time()
    job = executor.submit(sleeper, 300)
    deadline = time.time() + 30
    while job.get_info(mode="force").get("State") != "RUNNING":
        if time.time() > deadline:
            fail(f"job {job.job_id} not RUNNING after 30s (state {job.state}); is slurmdbd running?")
        time.sleep(0.25)
    log(f"job {job.job_id} RUNNING (sacct) after {time.time() - t:.2f}s")
    t = time.time()
    job.cancel()
    wait_done(job, 30, "cancelled job")
    state = job.get_info(mode="force").get("State", "")
    if not state.startswith("CANCELLED"):
        fail(f"cancelled job {job.job_id} has state {state!r}")
    log(f"cancelled job {job.job_id} done after {time.time() - t:.2f}s, state {state}")
    # submitit waits up to job._results_timeout_s (15 s) for a result file that
    # a cancelled job never writes; shorten that wait here.
    job._results_timeout_s = 1
    try:
        job.result()
    except Exception as e:
        log(f"result() of the cancelled job raises {type(e).__name__}")
    else:
        fail("result() of a cancelled job did not raise")

    t = time.time()
    job = executor.submit(boom)
    wait_done(job, 30, "failing job")
    state = wait_state(job, "FAILED", 30, "failing job")
    log(f"job {job.job_id} whose function raised: done after {time.time() - t:.2f}s, state {state}")
    try:
        job.result()
    except Exception as e:
        if "raised on purpose" not in str(e):
            fail(f"result() of the failing job raised without the job's error: {e}")
        log(f"result() of the failing job raises {type(e).__name__} with the job's error")
    else:
        fail("result() of a failing job did not raise")

    shutil.rmtree(folder, ignore_errors=True)
    log("OK: submitit works against the local SLURM cluster")
    return 0


if __name__ == "__main__":
    sys.exit(main())
