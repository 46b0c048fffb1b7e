#!/usr/bin/env bash
# xgrammar for the SGLang device kit, which has none (SGLang 0.5.14 pins xgrammar==0.2.1; without it the
# sglang engine runs with grammar_backend none and refuses constrained requests).
#
#   bash tests/gpu/xgrammar_kit.sh pack DIR            # here (needs the package index): DIR/xgrammar-0.2.1-cp312.tar.xz
#   bash tests/gpu/xgrammar_kit.sh install DIR TARGET  # on the device, after the kit's install.sh: unpacks into TARGET
#
# The wheel's static library and C++ headers (lib/, include/: build-time only) are left out, so the archive is
# ~9 MB and travels beside the kit (37 MB) within the 64 MiB a device call carries. Its dependencies (torch,
# triton, numpy, pydantic, transformers, apache-tvm-ffi) are on the device or in the kit.
set -euo pipefail
VERSION=0.2.1
NAME="xgrammar-${VERSION}-cp312.tar.xz"
case "${1:-}" in
  pack)
    DIR="${2:?usage: pack DIR}"
    mkdir -p "$DIR"
    STAGE="$(mktemp -d /tmp/xgrammar-pack.XXXXXX)"
    trap 'rm -rf "$STAGE"' EXIT
    "${PYTHON:-python3}" -m pip download -q "xgrammar==${VERSION}" --no-deps --only-binary=:all: \
      --python-version 3.12 --platform manylinux_2_28_x86_64 -d "$STAGE/wheel"
    mkdir "$STAGE/site"
    "${PYTHON:-python3}" -m zipfile -e "$STAGE"/wheel/xgrammar-*.whl "$STAGE/site"
    rm -rf "$STAGE/site/xgrammar/lib" "$STAGE/site/xgrammar/include"
    tar -C "$STAGE/site" -cf - . | xz -T0 -6 > "$DIR/$NAME"
    (cd "$DIR" && sha256sum "$NAME" > "$NAME.sha256")
    echo "xgrammar_kit.sh: wrote $DIR/$NAME ($(du -h "$DIR/$NAME" | cut -f1))"
    ;;
  install)
    DIR="${2:?usage: install DIR TARGET}"
    TARGET="${3:?usage: install DIR TARGET}"
    if command -v sha256sum >/dev/null; then (cd "$DIR" && sha256sum -c --quiet "$NAME.sha256"); fi
    mkdir -p "$TARGET"
    if command -v xz >/dev/null; then
      xz -dc "$DIR/$NAME" | tar -C "$TARGET" -xf -
    else
      "${PYTHON:-python3}" -c 'import sys, tarfile; tarfile.open(sys.argv[1], "r:xz").extractall(sys.argv[2])' "$DIR/$NAME" "$TARGET"
    fi
    PYTHONPATH="$TARGET${PYTHONPATH:+:$PYTHONPATH}" "${PYTHON:-python3}" -c \
      'import importlib.metadata as m, xgrammar; print("xgrammar_kit.sh: xgrammar", m.version("xgrammar"), "from", xgrammar.__file__)'
    ;;
  *)
    echo "usage: $0 pack DIR | install DIR TARGET" >&2
    exit 2
    ;;
esac
