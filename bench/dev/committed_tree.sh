# Device calls that run the committed tree, not the checkout's working tree (which may hold someone's uncommitted
# work: the device copies the working tree as it is), with every carried file in one directory (a call carries at
# most 8 paths).
#   bash bench/dev/committed_tree.sh pack [file or dir under .cache ...]     # CPU machine
#       -> .cache/pack/: head.tar.gz (git archive of HEAD without bench/results), commit, and copies of the named
#          files (e.g. .cache/tl-ship.tar.xz .cache/fla-tests .cache/call)
#   carry .device/bootstrap.sh .device/site-py312.tar.xz .device/wheels .cache/pack (and, for the HF test,
#   .cache/wheels-hf), then on the GPU machine, from the checkout's root:
#   source bench/dev/committed_tree.sh enter; <command>
#       -> HEAD's tree unpacked in /tmp/clean, the carried files linked under /tmp/clean/.cache, .device linked,
#          bootstrap sourced, FLASHDELTA_COMMIT exported, the shell in /tmp/clean
case "${1:-}" in
  pack)
    shift
    rm -rf .cache/pack && mkdir -p .cache/pack || exit 1
    git archive --format=tar HEAD $(git ls-tree --name-only HEAD | grep -v '^bench$') \
      $(git ls-tree --name-only HEAD bench/ | grep -v '^bench/results$') | gzip -9 > .cache/pack/head.tar.gz
    git rev-parse --short HEAD > .cache/pack/commit
    for f in "$@"; do cp -r "$f" .cache/pack/ || exit 1; done
    [ -n "$(git status --porcelain --untracked-files=no)" ] && echo "note: uncommitted changes are not in the pack"
    echo "$(cat .cache/pack/commit): $(du -sh .cache/pack | cut -f1) in .cache/pack" ;;
  enter)
    [ -f .cache/pack/head.tar.gz ] || { echo "carry .cache/pack (bash bench/dev/committed_tree.sh pack)" >&2; return 2; }
    rm -rf /tmp/clean && mkdir -p /tmp/clean/.cache && tar -xzf .cache/pack/head.tar.gz -C /tmp/clean || return 1
    for f in "$PWD"/.cache/pack/* "$PWD"/.cache/wheels-hf; do [ -e "$f" ] && ln -sfn "$f" /tmp/clean/.cache/; done
    ln -sfn "$PWD/.device" /tmp/clean/.device
    export FLASHDELTA_COMMIT=$(cat .cache/pack/commit)
    cd /tmp/clean && source .device/bootstrap.sh ;;
  *) echo "usage: bash bench/dev/committed_tree.sh pack [files]  |  source bench/dev/committed_tree.sh enter" >&2 ;;
esac
