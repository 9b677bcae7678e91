#!/bin/sh
# sshd, ssh and rsync for the `ray up` test (tests/test_cluster_launch.py), which runs its own sshd on
# 127.0.0.1. Where they are missing, they are installed with apt-get, as root or through passwordless sudo
# only; package scripts may not start sshd, and the ssh service the package enables is disabled again.
# Where that cannot be done, this says so and the test skips with the same reason. Never fails the build.
PATH="$PATH:/usr/sbin:/sbin"
have() { command -v sshd >/dev/null && command -v ssh >/dev/null && command -v rsync >/dev/null; }
have && exit 0
if [ "$(id -u)" = 0 ]; then SUDO=""
elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then SUDO="sudo -n"
else
  echo "ssh_tools: sshd/ssh/rsync missing and neither root nor passwordless sudo: the ray up test will skip"
  exit 0
fi
command -v apt-get >/dev/null || { echo "ssh_tools: no apt-get here: the ray up test will skip"; exit 0; }
$SUDO sh -c '
  policy=/usr/sbin/policy-rc.d; ours=
  [ -e $policy ] || { printf "#!/bin/sh\nexit 101\n" > $policy && chmod 755 $policy && ours=1; }
  enabled=$(systemctl is-enabled ssh.service 2>/dev/null)
  DEBIAN_FRONTEND=noninteractive apt-get update -qq &&
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends openssh-server openssh-client rsync
  status=$?
  [ "$enabled" = enabled ] || systemctl disable ssh.service ssh.socket >/dev/null 2>&1 || true
  [ -z "$ours" ] || rm -f $policy
  exit $status' || echo "ssh_tools: apt-get could not install openssh-server and rsync: the ray up test will skip"
exit 0
