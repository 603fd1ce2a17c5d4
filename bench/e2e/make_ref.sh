#!/usr/bin/env bash
# Build a reference copy of shardfuse from a commit, importable beside the working tree's as `shardfuse_ref`,
# so bench.e2e.run can measure both in one job (--impls shardfuse,shardfuse-ref): old and new, interleaved.
#
#   bash bench/e2e/make_ref.sh COMMIT [DIR]      # default DIR: .ref (git-ignored; carry it to the GPU machine)
#   PYTHONPATH=$PWD/.ref torchrun ... -m bench.e2e.run --impls shardfuse,shardfuse-ref --rounds 3
set -euo pipefail
cd "$(dirname "$0")/../.."
commit=${1:?usage: make_ref.sh COMMIT [DIR]}
dir=${2:-.ref}
rm -rf "$dir/shardfuse_ref"
mkdir -p "$dir"
tmp=$(mktemp -d)
git archive "$commit" shardfuse | tar -x -C "$tmp"
mv "$tmp/shardfuse" "$dir/shardfuse_ref"
rmdir "$tmp"
# Absolute imports inside the package name it; rename them so both versions load side by side.
grep -rlE '\bshardfuse\b' "$dir/shardfuse_ref" --include='*.py' | xargs sed -i -E 's/\bshardfuse([.:]| import)/shardfuse_ref\1/g'
echo "$(git rev-parse --short "$commit")" >"$dir/shardfuse_ref/REF_COMMIT"
echo "built $dir/shardfuse_ref from $(cat "$dir/shardfuse_ref/REF_COMMIT")"
