#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, so that sweeps go through hydra/launcher=slurm for
# real (issue 31): Debian's slurm-wlm and munge, a munge key, a slurm.conf for localhost with
# this machine's CPUs and memory, then munged, slurmctld and slurmd. With accounting, as a
# real cluster has: slurmdbd on a local MariaDB, so that sacct answers - submitit learns from
# sacct that a job ended without a result (killed, out of memory, past its time), without
# which the sweep's own process would wait for that job forever. Idempotent: "start" on a
# running cluster only checks it. Needs root (it installs packages and writes /etc).
#
#   bash experiments/local_slurm.sh start     # install if needed, configure, start, wait idle
#   bash experiments/local_slurm.sh status    # sinfo, or why there is no cluster
#   bash experiments/local_slurm.sh stop      # slurmctld, slurmd and munged stopped
#
# Then: python run.py -m hydra/launcher=slurm hydra.launcher.partition=debug \
#         hydra.launcher.additional_parameters={} execute=false net=tiny mem.all=90%,70%
set -euo pipefail

CONF=/etc/slurm/slurm.conf
DBD_CONF=/etc/slurm/slurmdbd.conf
DB=slurm_acct_db
DB_USER=slurm
DB_PASS=xengine-local  # a local socket only; the database holds job states of this machine
LOG_DIR=/var/log/slurm
PARTITION=debug

say() { echo "local_slurm: $*" >&2; }

need_root() {
  if [ "$(id -u)" -ne 0 ]; then
    say "needs root (it installs slurm-wlm and munge and writes /etc/slurm)"
    exit 2
  fi
}

install_packages() {
  local have=1
  for cmd in slurmctld slurmd munged slurmdbd mariadbd; do
    command -v "$cmd" >/dev/null || have=0
  done
  [ "$have" = 1 ] && return
  say "installing slurm-wlm, slurmdbd, munge and mariadb-server (apt)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null
  apt-get install -y -qq --no-install-recommends slurm-wlm slurmdbd munge mariadb-server >/dev/null
}

database_up() {
  mkdir -p /run/mysqld
  chown mysql:mysql /run/mysqld
  if ! mysqladmin ping --silent >/dev/null 2>&1; then
    (mysqld_safe --skip-networking >/dev/null 2>&1 &)
    for _ in $(seq 60); do
      mysqladmin ping --silent >/dev/null 2>&1 && break
      sleep 1
    done
  fi
  mysqladmin ping --silent >/dev/null 2>&1 || { say "mariadb did not start"; exit 1; }
  mysql -u root <<SQL
CREATE DATABASE IF NOT EXISTS $DB;
CREATE USER IF NOT EXISTS '$DB_USER'@'localhost' IDENTIFIED BY '$DB_PASS';
GRANT ALL ON $DB.* TO '$DB_USER'@'localhost';
SQL
}

slurmdbd_up() {
  mkdir -p /etc/slurm "$LOG_DIR"
  cat >"$DBD_CONF" <<DBD
# written by experiments/local_slurm.sh: job accounting for the one-node cluster
AuthType=auth/munge
DbdHost=localhost
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=$DB_USER
StoragePass=$DB_PASS
StorageLoc=$DB
LogFile=$LOG_DIR/slurmdbd.log
PidFile=/run/slurmdbd.pid
DBD
  chmod 600 "$DBD_CONF"
  pgrep -x slurmdbd >/dev/null || slurmdbd
  for _ in $(seq 30); do
    sacctmgr -n list cluster >/dev/null 2>&1 && break
    sleep 1
  done
  if ! sacctmgr -n -P list cluster format=cluster 2>/dev/null | grep -qx xengine; then
    sacctmgr -i add cluster xengine >/dev/null
  fi
}

munge_up() {
  if [ ! -s /etc/munge/munge.key ]; then
    dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
  fi
  chown munge:munge /etc/munge/munge.key
  chmod 400 /etc/munge/munge.key
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge
  if ! pgrep -x munged >/dev/null; then
    runuser -u munge -- /usr/sbin/munged
  fi
  munge -n | unmunge >/dev/null
}

write_conf() {
  local cpus mem_mb
  cpus=$(nproc)
  mem_mb=$(awk '/MemTotal/ {print int($2 / 1024) - 1024}' /proc/meminfo)
  mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd "$LOG_DIR"
  cat >"$CONF" <<EOF
# written by experiments/local_slurm.sh: one node, this machine
ClusterName=xengine
SlurmctldHost=localhost
SlurmUser=root
AuthType=auth/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
KillWait=10
NodeName=localhost NodeHostname=$(hostname -s) NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=$PARTITION Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF
  printf 'ConstrainCores=no\nConstrainRAMSpace=no\n' >/etc/slurm/cgroup.conf
}

running() { scontrol ping 2>/dev/null | grep -q "is UP"; }

accounting() { sacct -n -X -S now-1minutes >/dev/null 2>&1; }

start() {
  need_root
  if running && accounting && sinfo -h -o %T 2>/dev/null | grep -qE "idle|mix|alloc"; then
    say "already running: $(sinfo -h -o '%P %D %T %c CPUs %m MB'), with accounting"
    return
  fi
  if running && ! accounting; then  # started by an older version of this script
    say "restarting slurmctld with accounting"
    scontrol shutdown slurmctld >/dev/null 2>&1 || true
    sleep 1
  fi
  install_packages
  munge_up
  database_up
  write_conf
  slurmdbd_up
  pgrep -x slurmctld >/dev/null || slurmctld
  pgrep -x slurmd >/dev/null || slurmd -N localhost
  for _ in $(seq 60); do
    if running && accounting && sinfo -h -o %T 2>/dev/null | grep -qE "idle|mix|alloc"; then
      scontrol update nodename=localhost state=resume >/dev/null 2>&1 || true
      say "up: $(sinfo -h -o '%P %D %T %c CPUs %m MB'), with accounting (sacct)"
      return
    fi
    sleep 1
  done
  say "slurmctld, slurmd or slurmdbd did not come up; logs in $LOG_DIR"
  exit 1
}

stop() {
  need_root
  scontrol shutdown >/dev/null 2>&1 || true
  pkill -x slurmd 2>/dev/null || true
  pkill -x slurmctld 2>/dev/null || true
  pkill -x slurmdbd 2>/dev/null || true
  mysqladmin shutdown 2>/dev/null || true
  pkill -x munged 2>/dev/null || true
  say "stopped"
}

status() {
  if running; then
    sinfo
    if accounting; then say "accounting: sacct answers"; else say "accounting: sacct does not answer"; fi
  else
    say "no cluster: slurmctld does not answer (bash experiments/local_slurm.sh start)"
    exit 1
  fi
}

case "${1:-start}" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  *) say "usage: bash experiments/local_slurm.sh start|status|stop"; exit 2 ;;
esac
