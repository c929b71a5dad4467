"""``SUTConfig``'s own mechanics (``models/config.py``): a field's help and metadata
(``option``), the flat defaults of ``--arch sut_transformer`` (``flat_defaults``), and the
flat names of the side options (``cfg.encoder_layers``), each against values written out
here."""
import copy
import pickle

import pytest

from sut_fairseq.models.config import SUTConfig, flat_defaults, option
from sut_fairseq.models.standalone import model_args


def test_option_states_its_default_and_whether_the_decoder_follows_the_encoder():
    own = option(0.1, "dropout on sub-layer outputs")
    assert own.default == 0.1
    assert own.metadata == {"help": "dropout on sub-layer outputs (default: 0.1; presets may differ)",
                            "follows_encoder": False}
    follows = option(6, "maximum number of steps L", True)
    assert follows.default == 6
    assert follows.metadata == {
        "help": "maximum number of steps L (default: 6; the decoder's: the encoder's; presets may differ)",
        "follows_encoder": True}


def test_flat_defaults_name_every_encoder_option_and_only_the_decoders_own():
    defaults = flat_defaults()
    # the encoder side: every field of SideConfig under encoder_X, with sut_base's value
    assert {k: v for k, v in defaults.items() if k.startswith("encoder_")} == {
        "encoder_embed_dim": 512, "encoder_layers": 6, "encoder_normalize_before": False,
        "encoder_halting": "stick-breaking", "encoder_halting_kv": "mixture",
        "encoder_step_embedding": "none", "encoder_chunk_size": 0, "encoder_memory_slots": 10,
        "encoder_memory_update_layers": 1, "encoder_chunk_positions": "local"}
    # the decoder side: only the fields whose default is not the encoder's value
    assert {k: v for k, v in defaults.items() if k.startswith("decoder_")} == {
        "decoder_chunk_size": 0, "decoder_memory_slots": 10, "decoder_memory_update_layers": 1,
        "decoder_chunk_positions": "local"}
    # shared options under their own names; the side sub-configs themselves are not options
    assert (defaults["att_experts"], defaults["ffd_topk"], defaults["dropout"],
            defaults["max_source_positions"], defaults["hyper_router_temp"]) == (24, 4, 0.1, 1024, 1.0)
    assert "encoder" not in defaults and "decoder" not in defaults and "_name" not in defaults


@pytest.fixture(scope="module")
def cfg():
    args = model_args("sut_tiny", encoder_layers=5, decoder_layers=2, decoder_halting="act")
    return SUTConfig.from_namespace(args)


def test_flat_names_read_the_side_configs(cfg):
    assert (cfg.encoder_layers, cfg.decoder_layers) == (5, 2) == (cfg.encoder.layers, cfg.decoder.layers)
    assert (cfg.encoder_halting, cfg.decoder_halting) == ("stick-breaking", "act")


@pytest.mark.parametrize("name", ["encoder_nonsense", "middle_layers", "decoder_", "layers"])
def test_a_name_that_is_no_option_is_an_attribute_error_naming_it(cfg, name):
    with pytest.raises(AttributeError, match=rf"^SUTConfig has no option '{name}'$"):
        getattr(cfg, name)


def test_copies_and_pickles_keep_the_flat_names(cfg):
    """copy and pickle build the object before its fields (``__dict__`` empty): the flat
    names must then be AttributeErrors, not a recursion through ``__getattr__``."""
    bare = SUTConfig.__new__(SUTConfig)
    with pytest.raises(AttributeError, match="SUTConfig has no option 'encoder_layers'"):
        bare.encoder_layers
    for clone in (copy.deepcopy(cfg), pickle.loads(pickle.dumps(cfg))):
        assert clone.encoder_layers == 5 and clone.decoder_halting == "act"
