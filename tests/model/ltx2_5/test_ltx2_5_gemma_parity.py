"""Parity of the Gemma 4 prompt encoder against transformers' Gemma 4 text model (5.25,
``Gemma4UnifiedForCausalLM``, whose text path ``Gemma4UnifiedForConditionalGeneration`` runs for a
text-only prompt) on a tiny random config in float32 on the CPU: sliding and full layers with
their own head widths, proportional rotary, values from keys, shared key/value layers, and
left-padded prompts. Every hidden state the pipeline stacks is compared on the real tokens."""

from __future__ import annotations

import torch
from transformers import Gemma4UnifiedTextConfig
from transformers.models.gemma4_unified.modeling_gemma4_unified import Gemma4UnifiedForCausalLM

from mstar.model.ltx2_5.gemma import GemmaTextConfig, GemmaTextModel
from tests.support.diffusers_dirs import randomize

TOL = 1e-5
TINY = dict(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, global_head_dim=16, num_global_key_value_heads=1,
            attention_k_eq_v=True, sliding_window=3, num_kv_shared_layers=2,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention",
                         "sliding_attention", "full_attention"])


def test_gemma_hidden_states_parity():
    ref_config = Gemma4UnifiedTextConfig(**TINY)
    ref = Gemma4UnifiedForCausalLM(ref_config).eval()
    randomize(ref, 0, spread=0.3, weight_gain=1.5, gains=("layer_scalar",))
    with torch.no_grad():
        for i, layer in enumerate(ref.model.layers):
            layer.layer_scalar.fill_(0.5 + 0.25 * i)
    ours = GemmaTextModel(GemmaTextConfig.from_dict(ref_config.to_dict())).eval()
    state = {k.removeprefix("model."): v for k, v in ref.state_dict().items() if k != "lm_head.weight"}
    ours.load_state_dict(state, strict=True)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 64, (2, 9), generator=gen)
    mask = torch.ones(2, 9, dtype=torch.int64)
    mask[1, :4] = 0
    ids[1, :4] = 0
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
        got = ours.hidden_states(ids, mask)
    assert len(got) == len(want) == 7
    real = mask.bool()
    worst = 0.0
    for i, (g, w) in enumerate(zip(got, want)):
        err = ((g[real] - w[real]).abs().max() / w[real].abs().max()).item()
        worst = max(worst, err)
        assert err <= TOL, f"hidden state {i}: relative error {err:.3e}"
    print(f"[parity] gemma4 hidden states: max rel err {worst:.2e}")


def test_bfloat16_is_bit_identical():
    """In bfloat16 our hidden states equal transformers' bit for bit on the CPU, the reference's
    rotary frequencies kept in float32 as it computes them at load (a plain ``.to(bfloat16)``
    of the reference would round its frequency buffers too, which a bf16 load does not)."""
    ref_config = Gemma4UnifiedTextConfig(**TINY)
    ref = Gemma4UnifiedForCausalLM(ref_config).eval()
    randomize(ref, 0, spread=0.3, weight_gain=1.5)
    ours = GemmaTextModel(GemmaTextConfig.from_dict(ref_config.to_dict())).eval()
    ours.load_state_dict({k.removeprefix("model."): v for k, v in ref.state_dict().items() if k != "lm_head.weight"})
    frequencies = {n: b.clone() for n, b in ref.named_buffers() if "inv_freq" in n}
    ref, ours = ref.to(torch.bfloat16), ours.to(torch.bfloat16)
    for name, value in frequencies.items():
        owner, attr = name.rsplit(".", 1)
        setattr(ref.get_submodule(owner), attr, value)
    ids = torch.randint(3, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 9, dtype=torch.int64)
    mask[1, :4] = 0
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
        got = ours.hidden_states(ids, mask)
    real = mask.bool()
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g[real], w[real]), f"hidden state {i}"


def test_prompt_features_follow_pipeline():
    """Tokenize, encode and connect as ``LTX2Pipeline.encode_prompt`` + ``connectors`` do."""
    from diffusers import LTX2Pipeline
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors

    from mstar.model.ltx2_5.connectors import LtxConnectorsConfig, LtxTextConnectors
    from mstar.model.ltx2_5.text import LtxTextEncoder, tokenize
    from tests.support.diffusers_dirs import make_t5_tokenizer

    ref_config = Gemma4UnifiedTextConfig(**{**TINY, "vocab_size": 128})
    gemma = Gemma4UnifiedForCausalLM(ref_config).eval()
    randomize(gemma, 0, spread=0.3, weight_gain=1.5)
    connectors = LTX2TextConnectors(
        caption_channels=16, text_proj_in_factor=7, video_connector_num_attention_heads=2,
        video_connector_attention_head_dim=8, video_connector_num_layers=1, video_connector_num_learnable_registers=4,
        audio_connector_num_attention_heads=2, audio_connector_attention_head_dim=4, audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=4, connector_rope_base_seq_len=64, rope_type="split",
        per_modality_projections=True, video_hidden_dim=16, audio_hidden_dim=8).eval()
    randomize(connectors, 1, spread=0.3, weight_gain=1.5, offsets=("learnable_registers",))
    pipe = LTX2Pipeline(scheduler=None, vae=None, audio_vae=None, text_encoder=gemma, tokenizer=make_t5_tokenizer(),
                        connectors=connectors, transformer=None, vocoder=None)
    prompts = ["a cat walks on the moon ", "a dog"]
    with torch.no_grad():
        embeds, mask, _, _ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False, max_sequence_length=12,
                                                device=torch.device("cpu"))
        want = pipe.connectors(embeds, mask)
        ours = LtxTextEncoder(
            GemmaTextModel(GemmaTextConfig.from_dict(ref_config.to_dict())),
            LtxTextConnectors(LtxConnectorsConfig.from_dict(dict(connectors.config)))).eval()
        ours.text_encoder.load_state_dict(
            {k.removeprefix("model."): v for k, v in gemma.state_dict().items() if k != "lm_head.weight"})
        ours.connectors.load_state_dict(connectors.state_dict())
        ids, ours_mask = tokenize(make_t5_tokenizer(), prompts, max_length=12)
        got = ours(ids, ours_mask)
    torch.testing.assert_close(ours_mask, mask)
    for name, g, w in zip(("video", "audio"), got, want):
        err = ((g - w).abs().max() / w.abs().max()).item()
        print(f"[parity] prompt features {name}: max rel err {err:.2e}")
        assert err <= TOL
    torch.testing.assert_close(got[2], want[2])
