"""datatrove on the data benchmark corpus: the same filters (Gopher quality and repetition,
C4, FineWeb) and MinHash settings (5-grams, 14 buckets of 8 hashes, no verification), one
task, one worker. Prints MB/s of the filter step and of the four MinHash steps, and how many
documents MinHash removed."""
import os, sys, time, shutil

from datatrove.executor import LocalPipelineExecutor
from datatrove.pipeline.readers import JsonlReader
from datatrove.pipeline.writers import JsonlWriter
from datatrove.pipeline.filters import (C4QualityFilter, FineWebQualityFilter,
                                        GopherQualityFilter, GopherRepetitionFilter)
from datatrove.pipeline.dedup import (MinhashDedupBuckets, MinhashDedupCluster,
                                      MinhashDedupFilter, MinhashDedupSignature)
from datatrove.pipeline.dedup.minhash import MinhashConfig

corpus, work = sys.argv[1], sys.argv[2]
shutil.rmtree(work, ignore_errors=True)
mb = os.path.getsize(corpus) / 1e6
folder, name = os.path.dirname(corpus), os.path.basename(corpus)

def run(steps, logs):
    t = time.time()
    LocalPipelineExecutor(pipeline=steps, tasks=1, workers=1,
                          logging_dir=f"{work}/logs/{logs}").run()
    return time.time() - t

t = run([JsonlReader(folder, glob_pattern=name), GopherQualityFilter(), GopherRepetitionFilter(),
         C4QualityFilter(), FineWebQualityFilter(), JsonlWriter(f"{work}/filtered")], "filters")
print(f"datatrove filters: {t:.2f} s, {mb / t:.1f} MB/s")

cfg = MinhashConfig(n_grams=5, num_buckets=14, hashes_per_bucket=8)
t = run([JsonlReader(folder, glob_pattern=name), MinhashDedupSignature(f"{work}/sigs", config=cfg)], "sig")
t += run([MinhashDedupBuckets(f"{work}/sigs", f"{work}/buckets", config=cfg)], "buckets")
t += run([MinhashDedupCluster(f"{work}/buckets", f"{work}/remove", config=cfg)], "cluster")
t += run([JsonlReader(folder, glob_pattern=name),
          MinhashDedupFilter(f"{work}/remove", exclusion_writer=JsonlWriter(f"{work}/removed")),
          JsonlWriter(f"{work}/deduped")], "filter")
removed = 0
import glob, gzip
for p in glob.glob(f"{work}/removed/*"):
    removed += sum(1 for _ in gzip.open(p)) if p.endswith(".gz") else sum(1 for _ in open(p))
print(f"datatrove minhash (4 steps): {t:.2f} s, {mb / t:.1f} MB/s, removed {removed} documents")
