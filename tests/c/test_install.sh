#!/usr/bin/env bash
# test_install.sh PREFIX - libember as a C user gets it from
# `make install PREFIX=PREFIX` (run by `make test-c-install`, from the
# repository root): the installed files, the headers compiled alone, the
# symbols libember.so exports, and examples/c built through pkg-config, once
# against libember.a and once against libember.so, run on a file they write
# and on a corrupt copy of it.  Ends with "N passed, N failed".
set -uo pipefail

prefix=${1:?usage: tests/c/test_install.sh PREFIX}
cc=${CC:-cc}
out=$prefix/test
pc() { PKG_CONFIG_PATH=$prefix/lib/pkgconfig pkg-config "$@"; }
passed=0
failed=0
ok() { echo "ok   $1"; passed=$((passed + 1)); }
bad() { echo "FAIL $1"; failed=$((failed + 1)); }
# check DESCRIPTION COMMAND...: passes when COMMAND succeeds.
check() { local d=$1; shift; if "$@"; then ok "$d"; else bad "$d"; fi; }

command -v pkg-config >/dev/null || { echo "pkg-config is required (make apt, or apt-get install pkg-config)"; exit 1; }
rm -rf "$out" && mkdir -p "$out"
version=$(sed -n 's/^__version__ = "\(.*\)"/\1/p' python/ember/_version.py)
lib=$prefix/lib

# ------------------------------------------------------------ the installed files
check "pkg-config finds ember $version" test "$(pc --modversion ember)" = "$version"
check "libember.so.${version%%.*} -> libember.so.$version, libember.so -> libember.so.${version%%.*}" \
  test "$(readlink "$lib/libember.so.${version%%.*}")" = "libember.so.$version" \
  -a "$(readlink "$lib/libember.so")" = "libember.so.${version%%.*}" -a -f "$lib/libember.a"
check "soname is libember.so.${version%%.*}" \
  grep -q "SONAME.*\[libember.so.${version%%.*}\]" <(readelf -d "$lib/libember.so")
check "exactly the public headers are installed (not json.h, hadoop_conf.h, ...)" \
  diff <(cd csrc/include/ember && ls) <(cd "$prefix/include/ember" && ls)

# Each public header compiles on its own (as C11 and, for C++ users, C++11).
for h in "$prefix"/include/ember/*.h; do
  h=ember/$(basename "$h")
  check "$h compiles alone (C11)" $cc -std=c11 -Wall -Wextra -Werror -Wstrict-prototypes -pedantic \
    $(pc --cflags ember) -fsyntax-only -x c - <<<"#include <$h>"
  if command -v c++ >/dev/null; then
    check "$h compiles alone (C++11)" c++ -std=c++11 -Wall -Wextra -Werror $(pc --cflags ember) \
      -fsyntax-only -x c++ - <<<"#include <$h>"
  fi
done

# libember.so exports the public API of libember.a (every ember_ name but the
# ember__ internals; csrc/libember.map), nothing else.
nm -D --defined-only "$lib/libember.so" | awk '{print $3}' | sort >"$out/so.syms"
nm -g --defined-only "$lib/libember.a" | awk 'NF == 3 {print $3}' \
  | grep -E '^ember_[a-z0-9]|^ember__set_errno?$|^ember__set_error$' | sort >"$out/public.syms"
check "libember.so exports only ember_ names" test -z "$(grep -v '^ember_' "$out/so.syms")"
check "libember.so exports the public API of libember.a and no internals ($(wc -l <"$out/public.syms") symbols)" \
  diff "$out/public.syms" "$out/so.syms"

# ------------------------------------------------------------ examples/c through pkg-config
flags=(-std=c11 -Wall -Wextra -Werror -O2)
# Static: pkg-config --static adds Libs.private (-lcrypto -lz -lcurl); with
# both libraries in libdir -lember would pick the .so, so name the archive.
static_libs=$(pc --static --libs ember | sed 's/-lember\b/-l:libember.a/')
shared_libs="$(pc --libs ember) -Wl,-rpath,$(pc --variable=libdir ember)"
for p in tfrecord_summary write_sample; do
  check "$p builds against libember.a" $cc "${flags[@]}" $(pc --cflags ember) examples/c/$p.c \
    $static_libs -o "$out/$p-static"
  check "$p builds against libember.so" $cc "${flags[@]}" $(pc --cflags ember) examples/c/$p.c \
    $shared_libs -o "$out/$p-shared"
done
check "the static build does not load libember.so" \
  test -z "$(readelf -d "$out/tfrecord_summary-static" | grep libember)"
check "the shared build loads libember.so.${version%%.*} from $lib" \
  grep -q "libember.so.${version%%.*} => $lib/libember.so.${version%%.*}" <(ldd "$out/tfrecord_summary-shared")

# ------------------------------------------------------------ running them
cat >"$out/expected" <<'EOF'
  caption: bytes_list, in 5 of 10 records, 5 values (1..1 per record), 25 bytes
  image: float_list, in 10 of 10 records, 40 values (4..4 per record)
  label: int64_list, in 10 of 10 records, 10 values (1..1 per record)
EOF
for f in sample.tfrecord sample.tfrecord.gz; do
  check "write_sample writes $f" "$out/write_sample-shared" "$out/$f"
  for kind in static shared; do
    "$out/tfrecord_summary-$kind" "$out/$f" >"$out/$f.$kind.out" 2>&1
    check "tfrecord_summary ($kind) on $f: exit 0" test $? -eq 0
    check "tfrecord_summary ($kind) on $f: 10 records, 3 features" \
      grep -qx "$out/$f: 10 records, 3 features" "$out/$f.$kind.out"
    check "tfrecord_summary ($kind) on $f: per-feature counts" \
      diff "$out/expected" <(tail -n +2 "$out/$f.$kind.out")
  done
done
check "the static and shared writers write the same bytes" \
  sh -c "'$out/write_sample-static' '$out/static.tfrecord' && cmp '$out/static.tfrecord' '$out/sample.tfrecord'"

# A flipped byte in the data of the second record: the reader names the file,
# the record's byte offset and the failed check.  (Record 0 is its 8-byte
# length, 4-byte length CRC, the data and a 4-byte data CRC.)
len0=$(od -An -tu8 -N8 "$out/sample.tfrecord" | tr -d ' ')
rec1=$((12 + len0 + 4))
cp "$out/sample.tfrecord" "$out/corrupt.tfrecord"
byte=$(od -An -tu1 -j $((rec1 + 12 + 3)) -N1 "$out/corrupt.tfrecord" | tr -d ' ')
printf "$(printf '\\%03o' $((byte ^ 0xff)))" \
  | dd of="$out/corrupt.tfrecord" bs=1 seek=$((rec1 + 12 + 3)) conv=notrunc status=none
for kind in static shared; do
  "$out/tfrecord_summary-$kind" "$out/corrupt.tfrecord" >"$out/corrupt.$kind.out" 2>"$out/corrupt.$kind.err"
  check "tfrecord_summary ($kind) on a flipped byte: exit 1" test $? -eq 1
  check "tfrecord_summary ($kind) on a flipped byte: the message names the file, offset $rec1 and the CRC" \
    grep -q "$out/corrupt.tfrecord: corrupt record at byte offset $rec1: data CRC mismatch.*(EMBER_ECORRUPT)" \
    "$out/corrupt.$kind.err"
  check "tfrecord_summary ($kind) on a flipped byte: no summary on stdout" test ! -s "$out/corrupt.$kind.out"
done
head -c -3 "$out/sample.tfrecord" >"$out/truncated.tfrecord"
"$out/tfrecord_summary-shared" "$out/truncated.tfrecord" >/dev/null 2>"$out/truncated.err"
check "tfrecord_summary on a truncated file: exit 1" test $? -eq 1
check "tfrecord_summary on a truncated file: the message says so" \
  grep -q "truncated record at byte offset .*(EMBER_ETRUNCATED)" "$out/truncated.err"

echo "$passed passed, $failed failed"
test "$failed" -eq 0
