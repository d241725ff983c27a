"""The stream recomputed from a saved state, without a loader: `lineage` (which source records
made the rows of given steps) and `skip` (the state some global batches later), arithmetic for
a padded pipeline, planned in this process for a packed or filtered one."""
