class JobFailed(Exception):
    """A job that cannot run or did not finish; the message is the sentence the user sees."""
