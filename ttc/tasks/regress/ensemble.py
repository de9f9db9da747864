"""A regressor's ensemble (`pipeline.py --ensemble_size K`): the K networks trained on the same
split with seeds --seed, --seed+1, ... (ttc/training/stage.py trains the members with the
entry's trainer) merged by export into one graph, model.ensemble.onnx, whose outputs are
`prediction` (the members' mean, (batch,) in the target's units) and `member_predictions`
((K, batch), each member's). `inference.py --iterative ensemble` reads the members' spread from
it (testtime.py). Imports onnx; torch only where a graph is exported."""
from __future__ import annotations

import copy
from typing import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper

from ttc.tasks.regress import PREDICTION

MEMBERS_OUTPUT = "member_predictions"  # (members, batch): each member's prediction


def merged_members(members: Sequence[onnx.ModelProto]) -> onnx.ModelProto:
    """One graph running every member on the shared inputs (an hf graph's input_ids,
    attention_mask, token_type_ids too): `member_predictions` stacked, `prediction` their
    mean. The first member's metadata (an hf graph's padding id) travels along."""
    from ttc.testtime.iterative import member_nodes, runtime_inputs

    first = members[0]
    sources = runtime_inputs(first.graph)
    nodes, initializers, stacked = member_nodes(members, PREDICTION)
    axis = helper.make_tensor("ensemble_axis", TensorProto.INT64, [1], [0])
    rows = [f"ensemble_row{k}" for k in range(len(stacked))]
    nodes += [helper.make_node("Unsqueeze", [name, "ensemble_axis"], [row])
              for name, row in zip(stacked, rows)]
    nodes += [helper.make_node("Concat", rows, [MEMBERS_OUTPUT], axis=0),
              helper.make_node("ReduceMean", [MEMBERS_OUTPUT, "ensemble_axis"], [PREDICTION],
                               keepdims=0)]
    inputs = [copy.deepcopy(i) for i in first.graph.input if i.name in sources]
    outputs = [helper.make_tensor_value_info(PREDICTION, TensorProto.FLOAT, ["batch"]),
               helper.make_tensor_value_info(MEMBERS_OUTPUT, TensorProto.FLOAT,
                                             [len(members), "batch"])]
    graph = helper.make_graph(nodes, "regression_ensemble", inputs, outputs,
                              initializers + [axis])
    model = helper.make_model(graph, opset_imports=list(first.opset_import),
                              ir_version=first.ir_version)
    model.metadata_props.extend(copy.deepcopy(p) for p in first.metadata_props)
    onnx.checker.check_model(model)
    return model


def member_spread(session, x: np.ndarray, batch_size: int) -> np.ndarray:
    """(K, N) float64: each member's predictions over `x`, through the ensemble graph."""
    from ttc.serving.runtime import batches_of, graph_padding_id, session_runner

    run = session_runner(session, MEMBERS_OUTPUT)
    batches = batches_of(x, batch_size, graph_padding_id(session))
    return np.concatenate([run(b) for b in batches], axis=1).astype(np.float64)
