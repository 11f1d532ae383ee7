"""Model families: one file each (its Hugging Face config fields, weight names, KV shape, decoder layer,
and its MTP layer where it has one), a registry keyed by architecture (`registry.py`), the decoder they
share (`decoder.py`), and loading (`loader.py`). Import the submodules themselves: this package imports
nothing, so `modeldir` can read the registry without loading a model."""
