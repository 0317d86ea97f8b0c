#!/usr/bin/env python3
"""Builds the data benchmark corpus from Debian package files: each entry of every
/usr/share/doc/*/changelog.Debian.gz and every /usr/share/doc/*/copyright file is one JSONL
document, in sorted path order, up to a size cap. Prints the corpus's SHA-256; with
--expect-sha256 it fails when the corpus differs (another set of installed packages)."""
import argparse, glob, gzip, hashlib, json, os, sys

ap = argparse.ArgumentParser()
ap.add_argument("output")
ap.add_argument("--max-mb", type=float, default=64)
ap.add_argument("--expect-sha256", default="")
a = ap.parse_args()

cap = int(a.max_mb * 1e6)
paths = sorted(glob.glob("/usr/share/doc/*/changelog.Debian.gz") +
               glob.glob("/usr/share/doc/*/copyright"))
size = 0
with open(a.output + ".tmp", "w", encoding="utf-8") as out:
    for p in paths:
        if size >= cap:
            break
        try:
            raw = gzip.open(p).read() if p.endswith(".gz") else open(p, "rb").read()
        except OSError:
            continue
        text = raw.decode("utf-8", errors="replace")
        docs = [text]
        if p.endswith(".gz"):  # changelog entries end with the " -- maintainer  date" line
            docs, cur = [], []
            for line in text.split("\n"):
                cur.append(line)
                if line.startswith(" -- "):
                    docs.append("\n".join(cur).strip("\n"))
                    cur = []
        for i, d in enumerate(docs):
            if not d.strip():
                continue
            rec = json.dumps({"id": f"{p}#{i}", "text": d}, ensure_ascii=False) + "\n"
            out.write(rec)
            size += len(rec.encode())
os.replace(a.output + ".tmp", a.output)
sha = hashlib.sha256(open(a.output, "rb").read()).hexdigest()
print(f"{a.output}: {size / 1e6:.1f} MB, sha256 {sha}")
if a.expect_sha256 and sha != a.expect_sha256:
    sys.exit(f"corpus sha256 {sha} differs from the expected {a.expect_sha256}")
