"""Samples reach the trainer with their own reward, group and behaviour log-probs."""
from orchestrator.iteration.batches import attach_reference_logprobs, samples_batch
from rollout.samples import Sample, Samples
from trainer.batch import TokenDistribution


def test_samples_batch_keeps_every_field_in_place():
    samples = Samples([Sample(prompt_index=3, task_id="t", prompt_ids=[1, 2], completion_ids=[5, 6],
                              logprobs=[-0.1, -0.2], text="x", answer="y", reward=0.75)])
    dist = TokenDistribution(temperature=0.7, top_p=0.9)
    batch = samples_batch(samples, dist)
    seq = batch.sequences[0]
    assert (seq.prompt_ids, seq.completion_ids, seq.old_logprobs, seq.reward, seq.group) == (
        [1, 2], [5, 6], [-0.1, -0.2], 0.75, 3)
    assert batch.distribution == dist and seq.ref_logprobs == []
    attach_reference_logprobs(batch, [[-0.3, -0.4]])
    assert seq.ref_logprobs == [-0.3, -0.4]


def test_unscored_samples_are_left_out_of_training_and_kept_for_rescoring():
    """A sample without a reward is not trained on; a batch drawn ahead is rescored (the behaviour check) before
    its reward phase, when a trajectory scored after the rollout has none yet: all of it is kept then."""
    samples = Samples([Sample(prompt_index=k, task_id="t", prompt_ids=[1], completion_ids=[5], logprobs=[-0.1],
                              reward=reward) for k, reward in enumerate([None, 1.0])])
    assert [s.group for s in samples_batch(samples, TokenDistribution()).sequences] == [1]
    rescored = samples_batch(samples, TokenDistribution(), unscored=True).sequences
    assert [(s.group, s.reward, s.old_logprobs) for s in rescored] == [(0, 0.0, [-0.1]), (1, 1.0, [-0.1])]
