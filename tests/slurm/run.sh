# tests/slurm/run.sh MOE_DIST SOURCE_DIR: launcher/slurm/moe-dist.sbatch on a real Slurm.
#
# Starts a one-node cluster on localhost (munged, slurmctld, slurmd from Debian's
# slurm-wlm, installed with apt-get when missing; configs in a temporary directory that
# SLURM_CONF points at; 2 CPUs and 2 stand-in GPUs, character devices aliasing /dev/null,
# so the template's --gpus-per-task=1 is exercised as written). Then:
#   1. the template trains configs/tiny.ini with 2 tasks (ep 2): the job ends COMPLETED,
#      exit 0:0, and its log shows learning;
#   2. preemption: the same job again, sent SIGUSR1 mid-run through Slurm
#      (scancel --signal=USR1 --batch): moe-dist checkpoints and exits 75, the template
#      requeues the job, the requeued job resumes (--resume auto) and ends COMPLETED with
#      every step's loss equal to the uninterrupted run's, bit for bit;
#   3. the time limit: a 1-minute job with --signal=B:USR1@50 gets SIGUSR1, checkpoints
#      and is requeued (then cancelled).
# Exit status 77 (skipped) when not root or when Slurm cannot be installed or started.
# MOE_SLURM_KEEP=DIR keeps the daemons' logs and the jobs' output; MOE_SLURM_STEPS
# changes the run length (60); MOE_SLURM_NO_GPU=1 runs without stand-in GPUs.
# shellcheck shell=bash source=tests/lib.sh
source "$(dirname "$0")/../lib.sh"
[ -n "${WORK:-}" ] && [ -d "$WORK" ] || { echo "tests/lib.sh did not set up WORK" >&2; exit 1; }
SKIP=77
STEPS=${MOE_SLURM_STEPS:-60}
TEMPLATE=$SRC/launcher/slurm/moe-dist.sbatch
T0=$(date +%s)
D=$WORK/slurm
MOE=$(readlink -f "$MOE")
SRC=$(readlink -f "$SRC")

skip() { echo "SKIPPED: $*"; exit $SKIP; }
elapsed() { echo $(($(date +%s) - T0)); }

# ---- install ----
[ "$(id -u)" -eq 0 ] || skip "not root: cannot install and start Slurm"
need=()
for p in slurmctld slurmd slurm-client munge; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need+=("$p")
done
if [ ${#need[@]} -gt 0 ]; then
  echo "installing ${need[*]} (apt-get)"
  export DEBIAN_FRONTEND=noninteractive
  { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${need[@]}"; } \
    >"$WORK/apt.log" 2>&1 || { tail -5 "$WORK/apt.log"; skip "apt-get install ${need[*]} failed"; }
fi
echo "slurm $(dpkg-query -W -f='${Version}' slurmd) installed ($(elapsed)s)"

# ---- start a one-node cluster ----
stop_cluster() {
  if [ -s "$D/slurmctld.pid" ]; then # end this cluster's jobs first, then its daemons
    # shellcheck disable=SC2046 # one argument per job id
    scancel --full --quiet $(squeue -h -o %i 2>/dev/null) 2>/dev/null
    for _ in $(seq 1 20); do
      [ -z "$(squeue -h 2>/dev/null)" ] && ! pgrep -f '^slurmstepd: \[' >/dev/null && break
      sleep 0.5
    done
  fi
  for f in "$D/slurmd.pid" "$D/slurmctld.pid" "$D/munged.pid"; do
    [ -s "$f" ] && kill "$(cat "$f")" 2>/dev/null
  done
  sleep 0.5
  rm -rf "$WORK"
}
trap stop_cluster EXIT
mkdir -p "$D/state" "$D/spool" "$D/tmp" "$D/munge" "$D/jobs" "$D/dev"
chmod 700 "$D/munge"
free_port() { $PY -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
CTLD_PORT=$(free_port)
SLURMD_PORT=$(free_port)
NODE=$(hostname -s)
mungekey -c -k "$D/munge/munge.key" >/dev/null 2>&1 ||
  dd if=/dev/urandom of="$D/munge/munge.key" bs=1 count=1024 2>/dev/null
chmod 600 "$D/munge/munge.key"
munged --force --key-file="$D/munge/munge.key" --socket="$D/munge/socket" \
  --pid-file="$D/munged.pid" --log-file="$D/munged.log" --seed-file="$D/munge/seed" ||
  skip "munged does not start: $(tail -2 "$D/munged.log" 2>/dev/null)"
cat >"$D/slurm.conf" <<EOF
ClusterName=moetest
SlurmctldHost=$NODE(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
AuthType=auth/munge
AuthInfo=socket=$D/munge/socket,cred_expire=10
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$D/state
SlurmdSpoolDir=$D/spool
TmpFS=$D/tmp
SlurmctldPidFile=$D/slurmctld.pid
SlurmdPidFile=$D/slurmd.pid
SlurmctldLogFile=$D/slurmctld.log
SlurmdLogFile=$D/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
SlurmdParameters=config_overrides
MpiDefault=none
GresTypes=gpu
ReturnToService=2
JobRequeue=1
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MinJobAge=600
KillWait=5
MailProg=/bin/true
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=2 Gres=gpu:2 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
# Stand-in GPUs: Slurm wants device files; without mknod (an unprivileged container) the
# node has none and the job asks for none (sbatch --gpus-per-task=0).
GRES=Gres=gpu:2
NO_GPU=()
if [ -z "${MOE_SLURM_NO_GPU:-}" ] && mknod "$D/dev/nvidia0" c 1 3 2>/dev/null &&
  mknod "$D/dev/nvidia1" c 1 3 2>/dev/null; then
  echo "NodeName=$NODE Name=gpu File=$D/dev/nvidia[0-1]" >"$D/gres.conf"
else
  GRES=""
  NO_GPU=(--gpus-per-task=0)
  : >"$D/gres.conf"
  echo "no stand-in GPU devices: the jobs run with --gpus-per-task=0"
fi
sed -i "s/ Gres=gpu:2 / $GRES /" "$D/slurm.conf"
export SLURM_CONF=$D/slurm.conf
slurmctld -f "$SLURM_CONF" -i || skip "slurmctld does not start: $(tail -3 "$D/slurmctld.log")"
slurmd -f "$SLURM_CONF" || skip "slurmd does not start: $(tail -3 "$D/slurmd.log")"
for _ in $(seq 1 60); do
  [ "$(sinfo -h -n "$NODE" -o %t 2>/dev/null)" = idle ] && break
  sleep 0.5
done
[ "$(sinfo -h -n "$NODE" -o %t 2>/dev/null)" = idle ] ||
  skip "the node never became idle: $(sinfo -h 2>&1 | tail -1); $(tail -3 "$D/slurmctld.log")"
echo "cluster up after $(elapsed)s: $(sinfo -h -o '%P %D %t %N %G')"

# ---- helpers ----
job_field() { scontrol show job "$1" 2>/dev/null | tr ' ' '\n' | sed -n "s/^$2=//p" | head -1; }

ended() { # ended ID: the job is in a final state
  case $(job_field "$1" JobState) in
  COMPLETED | FAILED | CANCELLED | TIMEOUT | NODE_FAIL | OUT_OF_MEMORY | BOOT_FAIL | DEADLINE) return 0 ;;
  esac
  return 1
}

# wait_job ID SECONDS: waits until the job is in a final state; prints the state.
wait_job() {
  for _ in $(seq 1 $(($2 * 2))); do
    ended "$1" && break
    sleep 0.5
  done
  job_field "$1" JobState
}

# submit NAME extra-sbatch-options... -- moe-dist arguments: prints the job id.
submit() {
  local name=$1
  shift
  local opts=()
  while [ "$1" != "--" ]; do opts+=("$1"); shift; done
  shift
  MOE_DIST=$MOE sbatch --parsable --job-name="$name" --nodes=1 --ntasks-per-node=2 \
    --time=10 --chdir="$D/jobs" --output="$D/jobs/$name-%j.out" "${NO_GPU[@]}" "${opts[@]}" \
    "$TEMPLATE" "$SRC/configs/tiny.ini" --set train.steps="$STEPS" --set parallel.ep=2 "$@"
}

# same_losses A.jsonl B.jsonl: every step's loss equal (the last record of a step wins).
same_losses() {
  $PY - "$1" "$2" "$STEPS" <<'PY'
import json, sys
def steps(path):
    return {r["step"]: r for r in map(json.loads, open(path))}
a, b, n = steps(sys.argv[1]), steps(sys.argv[2]), int(sys.argv[3])
assert sorted(a) == sorted(b) == list(range(1, n + 1)), (len(a), len(b))
for s in a:
    for k in ("loss", "ce", "aux", "z", "grad_norm"):
        assert a[s][k] == b[s][k], f"step {s} {k}: {b[s][k]!r} vs {a[s][k]!r}"
print(f"{n} steps equal, final loss {a[n]['loss']:.6f}")
PY
}

# ---- 1. a whole run ----
t=$(date +%s)
id=$(submit plain -- --set log.jsonl="$D/jobs/plain.jsonl") || { fail "sbatch: $id"; finish; }
state=$(wait_job "$id" 150)
log="$D/jobs/plain-$id.out"
if [ "$state" = COMPLETED ] && [ "$(job_field "$id" ExitCode)" = "0:0" ]; then
  pass "job $id COMPLETED, exit 0:0, in $(($(date +%s) - t))s"
else
  fail "job $id: state '$state', exit $(job_field "$id" ExitCode)"
  sed 's/^/    /' "$log" | tail -15
  tail -5 "$D/slurmctld.log" | sed 's/^/    ctld: /'
fi
grep -q "^  .*:1 local 1/2: " "$log" && pass "the banner shows both ranks' binding" ||
  fail "no binding line for rank 1 in the log"
first=$(sed -n "s|^step 1/$STEPS loss \([0-9.]*\).*|\1|p" "$log")
final=$(sed -n 's/^done: .*final loss \([0-9.]*\).*/\1/p' "$log")
if [ -n "$first" ] && [ -n "$final" ] && $PY -c "import sys; sys.exit(not float('$final') < 0.7 * float('$first'))"; then
  pass "learns: loss $first -> $final"
else
  fail "no learning in the log: first '$first', final '$final'"
  tail -5 "$log" | sed 's/^/    /'
fi

# ---- 2. preemption: SIGUSR1 through Slurm, checkpoint, requeue, resume ----
t=$(date +%s)
id=$(submit preempt -- --set log.jsonl="$D/jobs/preempt.jsonl") || { fail "sbatch: $id"; finish; }
log="$D/jobs/preempt-$id.out"
signalled=""
for _ in $(seq 1 240); do # signal once the run is a third of the way
  if grep -q "^step $((STEPS / 3))/$STEPS " "$log" 2>/dev/null; then
    scancel --signal=USR1 --batch "$id" && signalled=yes
    break
  fi
  ended "$id" && break
  sleep 0.25
done
[ -n "$signalled" ] && pass "SIGUSR1 sent to job $id at step $((STEPS / 3))" ||
  fail "job $id never reached step $((STEPS / 3)) (state $(job_field "$id" JobState))"
# Slurm holds a requeued batch job until the previous run's credentials expire
# (cred_expire: 120 s by default, 10 s in this cluster), then starts it again.
state=$(wait_job "$id" 200)
restarts=$(job_field "$id" Restarts)
if [ "$state" = COMPLETED ] && [ "$(job_field "$id" ExitCode)" = "0:0" ] && [ "${restarts:-0}" -ge 1 ]; then
  pass "job $id requeued $restarts time(s) and COMPLETED in $(($(date +%s) - t))s"
else
  fail "job $id: state '$state', exit $(job_field "$id" ExitCode), restarts '$restarts'"
fi
grep -q "^stopped at step [0-9]* of $STEPS: checkpoint" "$log" && pass "moe-dist checkpointed and stopped" ||
  fail "no 'stopped at step' line"
grep -q "requeueing job $id" "$log" && pass "the template requeued it" || fail "no requeue line"
grep -q "^resumed from .*step [0-9]*" "$log" && pass "the requeued job resumed: $(grep -m1 '^resumed from' "$log")" ||
  fail "no 'resumed from' line"
if same_losses "$D/jobs/plain.jsonl" "$D/jobs/preempt.jsonl"; then
  pass "the interrupted run's losses equal the uninterrupted run's"
else
  fail "the interrupted run's losses differ"
fi
story=$(grep -E '^(moe-dist.sbatch|stopped|resumed|done:|  .* local [0-9]+/)' "$log")

# ---- 3. the time limit: --signal=B:USR1@50 on a 2-minute job (the template's mechanism).
# slurmctld looks at time limits periodically and signals early rather than late: the
# signal comes 40 to 70 s in (on a 1-minute job it came 2 to 27 s in, before moe-dist
# was always up).
t=$(date +%s)
id=$(submit limit --time=2 --signal=B:USR1@50 -- --set train.steps=100000) ||
  { fail "sbatch: $id"; finish; }
log3="$D/jobs/limit-$id.out"
for _ in $(seq 1 480); do
  grep -q "requeueing job $id" "$log3" 2>/dev/null && break
  ended "$id" && break
  sleep 0.25
done
if grep -q "^moe-dist.sbatch: SIGUSR1 at" "$log3" && grep -q "^stopped at step" "$log3" &&
  grep -q "requeueing job $id" "$log3"; then
  pass "time limit: SIGUSR1 $(($(date +%s) - t))s into a 2-minute job, checkpoint, requeue"
else
  fail "time limit: no SIGUSR1/checkpoint/requeue within $(($(date +%s) - t))s"
  tail -5 "$log3" | sed 's/^/    /'
fi
scancel "$id" 2>/dev/null

if [ -n "${MOE_SLURM_KEEP:-}" ]; then # keep the cluster's logs and the jobs' output
  mkdir -p "$MOE_SLURM_KEEP" && cp -r "$D"/*.log "$D"/*.conf "$D/jobs" "$MOE_SLURM_KEEP"/
fi
if [ "$FAILS" -ne 0 ]; then
  echo "--- $log"
  tail -25 "$log" | sed 's/^/    /'
else
  echo "--- the preempted job's story:"
  echo "$story" | sed 's/^/    /'
fi
echo "slurm test: $(elapsed)s in all"
finish
