"""datatrove on the data benchmark corpus, beside pollen: the same filters (Gopher quality and
repetition, C4, FineWeb) and MinHash settings (5-grams, 14 buckets of 8 hashes, no
verification), one worker (the buckets step as 14 tasks, one per bucket, run one after the
other). Prints MB/s of the filter step and of the four MinHash
steps (wall and CPU time), then compares the MinHash clusters datatrove found with pollen's
(`near-duplicates.jsonl` of a pollen run with only MinHash on, given as the third argument).

Usage: data_datatrove.py CORPUS.jsonl WORKDIR [POLLEN_NEAR_DUPLICATES.jsonl]"""
import glob, json, os, resource, shutil, struct, sys, time
from collections import Counter, defaultdict

from loguru import logger

logger.remove()  # datatrove's own logging and stats tables
from datatrove.executor import LocalPipelineExecutor
from datatrove.pipeline.readers import JsonlReader
from datatrove.pipeline.writers import JsonlWriter
from datatrove.pipeline.filters import (C4QualityFilter, FineWebQualityFilter,
                                        GopherQualityFilter, GopherRepetitionFilter)
from datatrove.pipeline.dedup import (MinhashDedupBuckets, MinhashDedupCluster,
                                      MinhashDedupFilter, MinhashDedupSignature)
from datatrove.pipeline.dedup.minhash import MinhashConfig

corpus, work = sys.argv[1], sys.argv[2]
pollen_dups = sys.argv[3] if len(sys.argv) > 3 else ""
shutil.rmtree(work, ignore_errors=True)
mb = os.path.getsize(corpus) / 1e6
folder, name = os.path.dirname(corpus), os.path.basename(corpus)


def cpu_seconds():
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def run(steps, logs, tasks=1):
    t, c = time.time(), cpu_seconds()
    LocalPipelineExecutor(pipeline=steps, tasks=tasks, workers=1,
                          logging_dir=f"{work}/logs/{logs}").run()
    return time.time() - t, cpu_seconds() - c


def report(what, wall, cpu):
    print(f"datatrove {what}: {wall:.2f} s wall, {wall and mb / wall:.2f} MB/s; "
          f"{cpu:.2f} s cpu, {cpu and mb / cpu:.2f} MB/s per core")


wall, cpu = run([JsonlReader(folder, glob_pattern=name), GopherQualityFilter(),
                 GopherRepetitionFilter(), C4QualityFilter(), FineWebQualityFilter(),
                 JsonlWriter(f"{work}/filtered")], "filters")
report("filters (gopher quality + repetition, c4, fineweb)", wall, cpu)

cfg = MinhashConfig(n_grams=5, num_buckets=14, hashes_per_bucket=8)
steps = [
    ([JsonlReader(folder, glob_pattern=name), MinhashDedupSignature(f"{work}/sigs", config=cfg)],
     "sig", 1),
    ([MinhashDedupBuckets(f"{work}/sigs", f"{work}/buckets", config=cfg)], "buckets", 14),
    ([MinhashDedupCluster(f"{work}/buckets", f"{work}/remove", config=cfg, save_cluster_id=True)],
     "cluster", 1),
    ([JsonlReader(folder, glob_pattern=name),
      MinhashDedupFilter(f"{work}/remove", exclusion_writer=JsonlWriter(f"{work}/removed")),
      JsonlWriter(f"{work}/deduped")], "filter", 1),
]
wall = cpu = 0.0
for pipeline, logs, tasks in steps:  # the buckets step runs one task per bucket, one at a time
    w, c = run(pipeline, logs, tasks)
    wall, cpu = wall + w, cpu + c
report("minhash (4 steps)", wall, cpu)

# ---- clusters: datatrove's (document index -> cluster id) against pollen's (id -> kept id)
ids = [json.loads(line)["id"] for line in open(corpus, encoding="utf-8")]
dt = {}
for path in glob.glob(f"{work}/remove/*.clusters"):
    raw = open(path, "rb").read()
    for doc, cluster in struct.iter_unpack("<II", raw):
        dt[ids[doc]] = cluster
removed_dt = set()
for path in glob.glob(f"{work}/remove/*.remove"):
    removed_dt |= {ids[d] for (d,) in struct.iter_unpack("<I", open(path, "rb").read())}
print(f"datatrove: {len(set(dt.values()))} clusters with duplicates, {len(dt)} documents in them, "
      f"{len(removed_dt)} removed")
if not pollen_dups:
    sys.exit(0)
pl = {}
for line in open(pollen_dups, encoding="utf-8"):
    r = json.loads(line)
    pl[r["id"]] = r["duplicate_of"]
    pl[r["duplicate_of"]] = r["duplicate_of"]
removed_pl = {i for i, k in pl.items() if i != k}
print(f"pollen: {len(set(pl.values()))} clusters with duplicates, {len(pl)} documents in them, "
      f"{len(removed_pl)} removed")


def pairs(sizes):
    return sum(n * (n - 1) // 2 for n in sizes)


# Pairs of documents in one cluster: in both, only pollen's, only datatrove's.
both = pairs(Counter((pl[i], dt[i]) for i in pl.keys() & dt.keys()).values())
p_pairs, d_pairs = pairs(Counter(pl.values()).values()), pairs(Counter(dt.values()).values())
print(f"same-cluster pairs: both {both}, only pollen {p_pairs - both}, "
      f"only datatrove {d_pairs - both}")
members_p, members_d = defaultdict(set), defaultdict(set)
for i, k in pl.items():
    members_p[k].add(i)
for i, k in dt.items():
    members_d[k].add(i)
same = {frozenset(s) for s in members_p.values()} & {frozenset(s) for s in members_d.values()}
print(f"clusters: identical {len(same)}, pollen {len(members_p)}, datatrove {len(members_d)}")
print(f"removed documents: both {len(removed_pl & removed_dt)}, "
      f"only pollen {len(removed_pl - removed_dt)}, only datatrove {len(removed_dt - removed_pl)}")
# A few examples of disagreement, to explain them.
for label, a, b, ma in (("only pollen", pl, dt, members_p), ("only datatrove", dt, pl, members_d)):
    shown = 0
    for k, s in ma.items():
        split = {b.get(i) for i in s}
        if len(split) > 1 or None in split:
            print(f"  e.g. {label}: cluster of {len(s)}: {sorted(s)[:3]}")
            shown += 1
            if shown == 3:
                break
