"""Meta-device construction: record a model's construction under ``annot.meta_init``, then
replay it shard by shard (`materialize`), unit by unit for engines that need real tensors
before they shard (`unit_allocation`)."""
