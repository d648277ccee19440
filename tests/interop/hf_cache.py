#!/usr/bin/env python3
"""Lay out / resolve Hugging Face hub cache snapshots offline (reference for `model.path: ORG/NAME[@REV]`).

Usage:
  python hf_cache.py make CACHE_DIR REPO_ID MODEL_DIR [--revision REV] [--no-tree] [--omit PATH]...
      Copies every file under MODEL_DIR into CACHE_DIR the way huggingface_hub leaves a downloaded repo:
        <CACHE_DIR>/models--ORG--NAME/blobs/<hash>                 file content (sha256 for LFS-like files,
                                                                   git blob sha1 otherwise, like the Hub etags)
        <CACHE_DIR>/models--ORG--NAME/snapshots/<commit>/<path>    relative symlink to ../../blobs/<hash>
                                                                   (one more ../ per subfolder level)
        <CACHE_DIR>/models--ORG--NAME/refs/<REV>                   commit hash, no trailing newline
        <CACHE_DIR>/models--ORG--NAME/trees/<commit>.json          tree listing cache (unless --no-tree)
      REV defaults to "main". If REV is a 40-hex commit hash it is used as the commit and no refs file is
      written (as huggingface_hub does); otherwise the commit is sha1 over the sorted (path, blob hash) pairs.
      --omit PATH leaves PATH out of the snapshot folder (but keeps it in the tree listing), producing an
      incomplete snapshot. Then calls snapshot_download(REPO_ID, revision=REV or None, cache_dir=CACHE_DIR,
      local_files_only=True) and prints {"snapshot": <returned path>, "commit": <hash>}, or
      {"error": "ExceptionClass: message", "commit": <hash>} if that raises (e.g. with --omit).
  python hf_cache.py resolve CACHE_DIR REPO_ID [--revision REV]
      Prints {"snapshot": <path>} or {"error": "ExceptionClass: message"} from
      snapshot_download(local_files_only=True). Exit status 0 in both cases.

CACHE_DIR "-" means cache_dir=None, i.e. huggingface_hub's env-var default (HF_HUB_CACHE, ...).
Exactly one JSON line is written to stdout; logs go to stderr. No network access is made.
"""

import argparse
import hashlib
import json
import os
import re
import shutil
import sys

# Files the Hub's default .gitattributes stores with LFS (plus anything > 10 MiB, which the Hub requires in LFS).
_LFS_SUFFIXES = (
    ".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".onnx", ".msgpack", ".model",
    ".npy", ".npz", ".pkl", ".pickle", ".tflite", ".ot", ".arrow", ".parquet", ".zip", ".tar", ".gz",
)
_LFS_MIN_SIZE = 10 * 1024 * 1024
_COMMIT_RE = re.compile(r"[0-9a-f]{40}")


def _hash_file(path, algo, prefix=b""):
    h = hashlib.new(algo)
    h.update(prefix)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _git_blob_sha1(data_or_path, size):
    prefix = b"blob %d\0" % size
    if isinstance(data_or_path, bytes):
        return hashlib.sha1(prefix + data_or_path).hexdigest()
    return _hash_file(data_or_path, "sha1", prefix)


def _list_files(model_dir):
    out = []
    for root, dirs, files in os.walk(model_dir, followlinks=True):
        dirs[:] = sorted(d for d in dirs if d not in (".git", "__pycache__"))
        for name in sorted(files):
            full = os.path.join(root, name)
            if os.path.isfile(full):
                out.append((os.path.relpath(full, model_dir).replace(os.sep, "/"), full))
    return out


def _snapshot_download(cache_dir, repo_id, revision):
    from huggingface_hub import snapshot_download

    return snapshot_download(
        repo_id,
        revision=revision,
        cache_dir=None if cache_dir == "-" else cache_dir,
        local_files_only=True,
    )


def cmd_make(args):
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name
    from huggingface_hub.utils import validate_repo_id

    validate_repo_id(args.repo_id)
    cache_dir = constants.HF_HUB_CACHE if args.cache_dir == "-" else args.cache_dir
    storage = os.path.join(os.path.abspath(os.path.expanduser(cache_dir)),
                           repo_folder_name(repo_id=args.repo_id, repo_type="model"))
    files = _list_files(args.model_dir)
    if not files:
        raise SystemExit(f"no files under {args.model_dir}")

    entries = []  # (relpath, source, blob_hash, tree_entry)
    for rel, src in files:
        size = os.path.getsize(src)
        if rel.endswith(_LFS_SUFFIXES) or size > _LFS_MIN_SIZE:
            sha256 = _hash_file(src, "sha256")
            pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()
            tree = {"size": size, "blob_id": _git_blob_sha1(pointer, len(pointer)),
                    "lfs_sha256": sha256, "lfs_size": size}
            blob = sha256
        else:
            blob = _git_blob_sha1(src, size)
            tree = {"size": size, "blob_id": blob}
        entries.append((rel, src, blob, tree))

    revision = args.revision
    if revision is not None and _COMMIT_RE.fullmatch(revision):
        commit = revision
    else:
        commit = hashlib.sha1("".join(f"{rel}\0{blob}\n" for rel, _, blob, _ in entries).encode()).hexdigest()

    blobs_dir = os.path.join(storage, "blobs")
    snap_dir = os.path.join(storage, "snapshots", commit)
    os.makedirs(blobs_dir, exist_ok=True)
    os.makedirs(snap_dir, exist_ok=True)
    omit = set(args.omit or [])
    for rel, src, blob, _ in entries:
        blob_path = os.path.join(blobs_dir, blob)
        if not os.path.exists(blob_path):
            tmp = blob_path + ".incomplete"
            shutil.copyfile(src, tmp)
            os.replace(tmp, blob_path)
        if rel in omit:
            continue
        link = os.path.join(snap_dir, *rel.split("/"))
        os.makedirs(os.path.dirname(link), exist_ok=True)
        if os.path.lexists(link):
            os.remove(link)
        # Same as huggingface_hub's _create_symlink: relative path from the link's folder to the blob.
        os.symlink(os.path.relpath(blob_path, os.path.dirname(link)), link)

    ref_name = revision if revision is not None else constants.DEFAULT_REVISION
    if ref_name != commit:
        ref_path = os.path.join(storage, "refs", *ref_name.split("/"))
        os.makedirs(os.path.dirname(ref_path), exist_ok=True)
        with open(ref_path, "w") as f:
            f.write(commit)  # no newline, like _cache_commit_hash_for_specific_revision

    if not args.no_tree:
        trees_dir = os.path.join(storage, "trees")
        os.makedirs(trees_dir, exist_ok=True)
        data = {"format_version": 1, "files": {rel: tree for rel, _, _, tree in sorted(entries)}}
        with open(os.path.join(trees_dir, f"{commit}.json"), "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)

    try:
        snapshot = _snapshot_download(args.cache_dir, args.repo_id, revision)
    except Exception as e:  # noqa: BLE001 - e.g. IncompleteSnapshotError with --omit
        return {"error": f"{type(e).__name__}: {e}", "commit": commit}
    return {"snapshot": str(snapshot), "commit": commit}


def cmd_resolve(args):
    try:
        return {"snapshot": str(_snapshot_download(args.cache_dir, args.repo_id, args.revision))}
    except Exception as e:  # noqa: BLE001 - the error class/message is the expected output
        return {"error": f"{type(e).__name__}: {e}"}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("cache_dir")
    m.add_argument("repo_id")
    m.add_argument("model_dir")
    m.add_argument("--revision")
    m.add_argument("--no-tree", action="store_true")
    m.add_argument("--omit", action="append")
    r = sub.add_parser("resolve")
    r.add_argument("cache_dir")
    r.add_argument("repo_id")
    r.add_argument("--revision")
    args = p.parse_args(argv)
    result = cmd_make(args) if args.cmd == "make" else cmd_resolve(args)
    sys.stdout.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
