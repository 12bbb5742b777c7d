#!/usr/bin/env bash
# Builds the C fuzz targets with libFuzzer, ASan and UBSan (Debian's clang: apt-get install clang) into $1
# (default build/fuzz), each linked with the whole C core but the file it includes.
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=${1:-build/fuzz}
mkdir -p "$out"
flags=(-g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined -Inative/include -Inative/src)
core=(native/src/*.c)
for target in json_scan heartbeat comm; do
    sources=()
    for source in "${core[@]}"; do
        [ "$target" = heartbeat ] && [ "$source" = native/src/heartbeat.c ] || sources+=("$source")
    done
    clang "${flags[@]}" "tests/fuzz/native/fuzz_$target.c" "${sources[@]}" -lpthread -ldl -lm -o "$out/fuzz_$target"
done
