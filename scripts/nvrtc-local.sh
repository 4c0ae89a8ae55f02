#!/usr/bin/env bash
# nvrtc-local.sh fetches NVRTC (and, with --sass, cuobjdump and nvdisasm)
# from Debian's non-free archive into a folder of the repository, for a
# machine with no CUDA: NVRTC needs no GPU, so with it the tests that read
# ptxas's report run anywhere (backend/cuda's TestKernelResources and
# TestLabResources: registers, spills and wgmma serialization of every
# kernel and lab variant), and cuobjdump prints a cubin's SASS.
#
#   bash scripts/nvrtc-local.sh [--sass] [DIR]     # DIR defaults to .nvrtc
#   eval "$(bash scripts/nvrtc-local.sh --env)"    # the variables to use it
#   go test ./backend/cuda -run 'KernelResources|LabResources' -v
#
# It uses the machine's own Debian mirror (the URIs of its apt sources)
# with a private apt state under DIR: nothing in /etc/apt changes and
# nothing is installed. The packages are Debian 13's (CUDA 12.4), whose
# ptxas reads sm_90a; the GPU machine's NVRTC is newer, so a count may
# differ by a few registers there (kernels/dev/README.md).
set -euo pipefail

sass=0
env_only=0
dir=""
for a in "$@"; do
  case "$a" in
  --sass) sass=1 ;;
  --env) env_only=1 ;;
  -h | --help)
    sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'
    exit 0
    ;;
  -*)
    echo "nvrtc-local.sh: unknown option $a (see --help)" >&2
    exit 2
    ;;
  *) dir=$a ;;
  esac
done
root=$(cd "$(dirname "$0")/.." && pwd)
dir=${dir:-$root/.nvrtc}
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
lib=$dir/root/usr/lib/x86_64-linux-gnu

if [[ $env_only == 1 ]]; then
  if [[ ! -e $lib/libnvrtc.so.12 ]]; then
    echo "nvrtc-local.sh: no NVRTC in $dir yet: run bash scripts/nvrtc-local.sh first" >&2
    exit 1
  fi
  # NVRTC loads its builtins library by name, so the loader path too.
  echo "export MKTRAIN_CUDA_LIB_DIR='$lib' LD_LIBRARY_PATH='$lib'\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
  exit 0
fi

if [[ $(dpkg --print-architecture 2>/dev/null) != amd64 ]]; then
  echo "nvrtc-local.sh: Debian's NVRTC packages are amd64 only" >&2
  exit 1
fi
# The mirror this machine's apt already uses (deb822 or one-line sources).
mirror=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
if [[ -z $mirror ]]; then
  mirror=$(awk '$1 == "deb" {for (i = 2; i <= NF; i++) if ($i ~ /^https?:/) {print $i; exit}}' /etc/apt/sources.list 2>/dev/null || true)
fi
if [[ -z $mirror ]]; then
  echo "nvrtc-local.sh: found no Debian mirror in /etc/apt's sources" >&2
  exit 1
fi
keyring=/usr/share/keyrings/debian-archive-keyring.gpg
[[ -r $keyring ]] || { echo "nvrtc-local.sh: no $keyring (package debian-archive-keyring)" >&2; exit 1; }

state=$dir/apt
mkdir -p "$state/lists/partial" "$state/cache/archives/partial" "$state/parts" "$state/prefs" "$state/tmp" "$dir/debs"
chmod 1777 "$state/tmp"
echo "deb [signed-by=$keyring] $mirror trixie non-free" >"$state/sources.list"
apt=(-o Dir::Etc::SourceList="$state/sources.list" -o Dir::Etc::SourceParts="$state/parts"
  -o Dir::Etc::PreferencesParts="$state/prefs" -o Dir::State::Lists="$state/lists"
  -o Dir::Cache="$state/cache" -o APT::Sandbox::User=root -o Debug::NoLocking=1)
export TMPDIR=$state/tmp
echo "nvrtc-local.sh: reading the package lists (Debian 13 non-free)"
apt-get "${apt[@]}" -qq update
builtins=$(apt-cache "${apt[@]}" depends libnvrtc12 | awk '/Depends: libnvrtc-builtins/ {print $2; exit}')
pkgs=(libnvrtc12 "${builtins:?libnvrtc12 names no builtins package}")
[[ $sass == 1 ]] && pkgs+=(nvidia-cuda-toolkit)
echo "nvrtc-local.sh: fetching ${pkgs[*]}"
(cd "$dir/debs" && apt-get "${apt[@]}" -qq download "${pkgs[@]}")
for deb in "$dir"/debs/*.deb; do dpkg -x "$deb" "$dir/root"; done
echo "nvrtc-local.sh: NVRTC is in $lib"
[[ $sass == 1 ]] && echo "nvrtc-local.sh: cuobjdump and nvdisasm are in $dir/root/usr/bin"
echo "use it with: eval \"\$(bash scripts/nvrtc-local.sh --env $dir)\""
