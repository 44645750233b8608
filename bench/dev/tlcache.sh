# TileLang's kernel cache, compiled on the CPU machine, carried to the GPU machine packed (xz -9e, ~30x smaller than
# the cache itself: its 64 MB dictionary spans the near-identical kernels, 250 MB -> 7.7 MB against 15.3 MB at xz's
# default level; the device call's working tree is limited to 64 MiB).
#   TILELANG_CACHE_DIR=.cache/tl-ship python3 bench/precompile.py --tests --grid   # CPU: fill it (see its --help)
#   bash bench/dev/tlcache.sh pack                              # -> .cache/tl-ship.tar.xz (carry that path)
#   source bench/dev/tlcache.sh unpack                          # GPU machine: unpack, export TILELANG_CACHE_DIR
# TileLang's cache key (its version, the native libraries, the kernel's TIR, the target) matches on the GPU
# machine when both sides run the same TileLang build. The peers' TileLang kernels (FlashQLA's) compile only on the GPU
# machine (their target comes from the device): `PACK_NEW=1 bash bench/dev/grid.sh ...` returns the kernels a grid
# call compiled as $OUT/tl-new-<half>.tar.xz; saved as .cache/tl-peers.tar.xz and carried, `unpack` adds them, so the
# next grid's phase 1 finds FlashQLA's kernels compiled (it took ~300 s a backward grid call). Every other
# .cache/tl-*.tar.xz carried (archives of a tl-ship/ directory: a parked kernel's builds) is added the same way.
case "${1:-}" in
  pack) XZ_OPT=${XZ_OPT:-"-9e -T0"} tar -C .cache -cJf .cache/tl-ship.tar.xz tl-ship && ls -la .cache/tl-ship.tar.xz ;;
  unpack) for f in .cache/tl-ship.tar.xz $(ls .cache/tl-*.tar.xz | grep -v /tl-ship.tar.xz); do   # tl-ship first
            [ -f "$f" ] && python3 -c "import tarfile, sys; tarfile.open(sys.argv[1]).extractall('/tmp')" "$f"
          done
          [ -d /tmp/tl-ship ] &&
          export TILELANG_CACHE_DIR=/tmp/tl-ship && echo "TileLang cache: $(ls /tmp/tl-ship/*/linux-x86_64/kernels | wc -l) kernels" ;;
  *) echo "usage: bench/dev/tlcache.sh pack|unpack" >&2 ;;
esac
