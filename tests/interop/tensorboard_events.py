"""What TensorBoard itself reads from the event files qtrain writes.

    python tensorboard_events.py RUN_TB_DIR

Loads RUN_TB_DIR with TensorBoard's EventAccumulator (keeping every scalar and tensor; without
TensorFlow it reads records through tensorboard's pure-Python reader, which checks both masked
CRC32Cs and silently stops at the first bad record) and prints one JSON object:
{"scalars": {tag: [[step, value], ...]}, "texts": {tag: [[step, text], ...]},
 "files": [event file basenames]}. Scalars are the Summary.Value.simple_value ones (float32
widened to a double); texts are the DT_STRING tensors of the "text" plugin, decoded as UTF-8
(a list of strings where the tensor holds more than one).
Used by qtrain's TensorBoard writer test (trainer/logging/tensorboard_writer.cpp) to check that
TensorBoard accepts its files.
"""
import json
import os
import sys

from tensorboard.backend.event_processing import event_accumulator as ea
from tensorboard.backend.event_processing import io_wrapper


def text(tensor_proto):
    strings = [s.decode("utf-8") for s in tensor_proto.string_val]
    return strings[0] if len(strings) == 1 else strings


run_dir = sys.argv[1]
acc = ea.EventAccumulator(run_dir, size_guidance={ea.SCALARS: 0, ea.TENSORS: 0})
acc.Reload()
scalars = {tag: [[e.step, e.value] for e in acc.Scalars(tag)] for tag in acc.Tags()[ea.SCALARS]}
texts = {tag: [[e.step, text(e.tensor_proto)] for e in acc.Tensors(tag)]
         for tag in acc.Tags()[ea.TENSORS]
         if tag in acc.summary_metadata
         and acc.summary_metadata[tag].plugin_data.plugin_name == "text"}
files = sorted(f for f in os.listdir(run_dir) if io_wrapper.IsSummaryEventsFile(f))
print(json.dumps({"scalars": scalars, "texts": texts, "files": files}))
