"""The transport paths of the weight channel, one file per path, each holding both of its ends behind the
`FetchPath` Protocol of `base.py` (the order a fetch tries them is `rollpool.weights.manifest.plan`'s). `delta.py` is
the subscriber's end of delta versions, which ride the network path: a version rebuilt from a base held here."""
