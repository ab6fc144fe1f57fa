#!/usr/bin/env bash
# relocate_ompi.sh PREFIX: a copy of this machine's Open MPI 4.1 (Debian's openmpi-bin, under /usr) installed under
# PREFIX, a folder on no PATH, as Open MPI lives in /opt/hpcx/ompi in NVIDIA's images. The two-namespace launch test
# (tests/deploy/test_netns_launch.py) runs serve.sh's mpirun from it, so that the ssh session on the worker finds
# orted only through mpirun's --prefix. Layout: PREFIX/bin (mpirun, orterun, orted), PREFIX/lib (the libraries:
# what --prefix puts on the remote LD_LIBRARY_PATH, libmpi.so among them, which mpi4py's loader opens first), the
# components and help files where Open MPI looks for them once OPAL_PREFIX=PREFIX (its install dirs relative to
# the prefix; ompi_info --path). Open MPI 4.1 forwards OPAL_PREFIX to the remote orted (plm_rsh_module.c).
set -euo pipefail
PREFIX="${1:?usage: relocate_ompi.sh PREFIX}"
command -v ompi_info >/dev/null || { echo "no Open MPI here: make mpi-env installs Debian's openmpi-bin" >&2; exit 1; }
dir() { ompi_info --path "$1" | awk '{print $2}'; }
SYSPREFIX=$(dir prefix)
LIBDIR=$(dir libdir)
PKGLIBDIR=$(dir pkglibdir)
PKGDATADIR=$(dir pkgdatadir)
TMP="$PREFIX.tmp"
rm -rf "$TMP"
mkdir -p "$TMP/bin" "$TMP/lib" "$TMP/${PKGLIBDIR#"$SYSPREFIX"/}" "$TMP/${PKGDATADIR#"$SYSPREFIX"/}"
cp "$SYSPREFIX/bin/orterun" "$SYSPREFIX/bin/orted" "$TMP/bin/"
ln -s orterun "$TMP/bin/mpirun"
# the shared libraries the binaries and components need (sonames: libmpi.so.40, libmca_common_sm.so.40, ...)
for lib in "$LIBDIR"/libmpi.so "$LIBDIR"/libopen-rte.so "$LIBDIR"/libopen-pal.so "$LIBDIR"/libmca_common_*.so; do
  real=$(basename "$(readlink -f "$lib")")   # libmpi.so.40.30.4: its soname is libmpi.so.40
  version=${real#*.so.}
  cp -L "$lib" "$TMP/lib/${real%%.so.*}.so.${version%%.*}"
done
ln -s libmpi.so.40 "$TMP/lib/libmpi.so"
cp -rL "$PKGLIBDIR/." "$TMP/${PKGLIBDIR#"$SYSPREFIX"/}/"
cp -r "$PKGDATADIR/." "$TMP/${PKGDATADIR#"$SYSPREFIX"/}/"
rm -rf "$PREFIX"
mv "$TMP" "$PREFIX"
echo "Open MPI $(ompi_info --version | head -n 1 | awk '{print $NF}') relocated to $PREFIX"
