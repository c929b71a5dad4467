"""What ``sut_label_smoothed_cross_entropy`` logs (``reduce_metrics``), worked by hand from
logging outputs: the auxiliary losses per target token, L_ACT per halting unit, executed
steps per real position, steps per chunk, the exit losses in base 2 in step order, each
weighted by its own denominator when fairseq averages several batches; nothing logged for
a side without positions or chunks."""
import math

from fairseq.logging import metrics

from sut_fairseq.criterions.sut_label_smoothed_cross_entropy import SUTLabelSmoothedCrossEntropyCriterion

Criterion = SUTLabelSmoothedCrossEntropyCriterion
BASE = dict(loss=0.0, nll_loss=0.0, ntokens=1, nsentences=1)


def _reduce(*batches):
    """``reduce_metrics`` once per batch (a list of logging outputs), as fairseq's trainer
    calls it once per update, inside one aggregation; the smoothed values."""
    with metrics.aggregate(new_root=True) as agg:
        for logging_outputs in batches:
            Criterion.reduce_metrics(logging_outputs)
        return agg.get_smoothed_values()


def test_one_batch_of_two_logging_outputs_by_hand():
    logs = [dict(BASE, sample_size=10, mim=1.23456, switch=0.5, act_enc=6.0, act_units_enc=4,
                 act_dec=2.5, act_units_dec=5, steps_enc=13, positions_enc=4, steps_dec=9,
                 positions_dec=5, chunks_enc=2, chunk_steps_enc=7, exit_loss_10=0.7,
                 exit_loss_2=1.4, exit_loss_1=2.8),
            dict(BASE, sample_size=6, mim=0.1, switch=0.25, act_enc=3.0, act_units_enc=2,
                 act_dec=0.0, act_units_dec=0, steps_enc=5, positions_enc=2, steps_dec=0,
                 positions_dec=0, chunks_enc=1, chunk_steps_enc=2, exit_loss_10=0.1,
                 exit_loss_2=0.2, exit_loss_1=0.4)]
    values = _reduce(logs)
    assert values["mim"] == round(1.33456 / 16, 4) and values["switch"] == round(0.75 / 16, 4)
    assert values["act_enc"] == round(9.0 / 6, 3) and values["act_dec"] == round(2.5 / 5, 3)
    assert values["steps_enc"] == round(18 / 6, 3) and values["steps_dec"] == round(9 / 5, 3)
    assert values["chunk_steps_enc"] == round(9 / 3, 3) and "chunk_steps_dec" not in values
    for key, total in (("exit_loss_1", 3.2), ("exit_loss_2", 1.6), ("exit_loss_10", 0.8)):
        assert values[key] == round(total / 16 / math.log(2), 3), key
    exits = [k for k in values if k.startswith("exit_loss_")]
    assert exits == ["exit_loss_1", "exit_loss_2", "exit_loss_10"]          # in step order
    assert Criterion.logging_outputs_can_be_summed() is True


def test_batches_are_averaged_with_each_metrics_own_weight():
    """Two updates: each value is weighted by its denominator (target tokens for the
    auxiliary and exit losses, halting units for L_ACT, positions for steps, chunks for
    chunk steps)."""
    first = dict(BASE, sample_size=2, mim=1.0, switch=2.0, act_enc=1.0, act_units_enc=1, steps_enc=2,
                 positions_enc=1, act_dec=4.0, act_units_dec=4, steps_dec=12, positions_dec=3,
                 chunks_dec=1, chunk_steps_dec=5, exit_loss_1=2.0)
    second = dict(BASE, sample_size=6, mim=0.0, switch=0.0, act_enc=9.0, act_units_enc=3, steps_enc=4,
                  positions_enc=4, act_dec=1.0, act_units_dec=1, steps_dec=2, positions_dec=1,
                  chunks_dec=3, chunk_steps_dec=3, exit_loss_1=0.0)
    values = _reduce([first], [second])
    # per batch: mim 0.5 / 0 (weights 2, 6); act_enc 1 / 3 (weights 1, 3); steps_enc 2 / 1
    # (weights 1, 4); act_dec 1 / 1; steps_dec 4 / 2 (weights 3, 1); chunk steps 5 / 1 (1, 3)
    assert values["mim"] == round((0.5 * 2) / 8, 4) and values["switch"] == round((1.0 * 2) / 8, 4)
    assert values["act_enc"] == round((1 * 1 + 3 * 3) / 4, 3)
    assert values["steps_enc"] == round((2 * 1 + 1 * 4) / 5, 3)
    assert values["steps_dec"] == round((4 * 3 + 2 * 1) / 4, 3)
    assert values["chunk_steps_dec"] == round((5 * 1 + 1 * 3) / 4, 3)
    assert values["exit_loss_1"] == round((1.0 / math.log(2)) * 2 / 8, 3)


def test_a_side_without_positions_or_chunks_logs_nothing():
    """(A batch without target tokens never reaches here: fairseq's own reduce divides by
    ``sample_size`` first.)"""
    log = dict(BASE, sample_size=4, mim=1.0, switch=1.0, act_enc=1.0, act_units_enc=1, steps_enc=1,
               positions_enc=0, exit_loss_1=1.0)
    values = _reduce([log])
    assert {"mim", "switch", "exit_loss_1"} <= set(values)
    assert not {"act_enc", "steps_enc", "act_dec", "steps_dec", "chunk_steps_enc",
                "chunk_steps_dec"} & set(values)
