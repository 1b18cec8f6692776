"""Adapters that put mixc's ops inside other libraries' models.

    from mixc.integrations import transformers as mixc_hf
    model = mixc_hf.patch(model, mode="auto")     # Hugging Face transformers (docs/integrations.md)

Nothing here is imported by `import mixc`; each adapter imports only mixc's runtime and torch.
"""
