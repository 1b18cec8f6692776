"""Adapters that put mixc's ops inside other libraries' models.

    from mixc.integrations import transformers as mixc_hf
    model = mixc_hf.patch(model, mode="auto")     # Hugging Face transformers (docs/integrations.md)

and mixc's own model in another library's interface:

    import mixc.integrations.hf_model             # MixerLM as transformers' model type "mixc"

Nothing here is imported by `import mixc`; the adapters import only mixc's runtime and torch,
hf_model mixc.nn and the pipeline (to compile a spec's text) too.
"""
