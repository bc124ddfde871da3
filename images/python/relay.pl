# pyberth relay (docs/design.md D12): the long-lived end of the exec the server holds.
#
# `relay.pl attach DIR -- CMD...` is what the server execs (through `sh`, for images without
# perl): when a keeper listens on DIR's socket it relays to it at once; when none answers and
# CMD is our agent, it starts the agent as its own keeper (under keeper.py's lock) and relays
# to it; otherwise it becomes `keeper.py attach`, which starts one and execs `relay.pl FD` with
# the socket's fd. Neither a reattach nor a session's first attach starts a Python interpreter
# before the agent (~40-100 ms here). A Python relay would cost ~4.7 MiB private for each
# idle session, perl (perl-base is Essential in Debian) about a fifth of it. It does what
# keeper.py's relay() does, byte for byte: stdin goes to the keeper in frames of kind `0`;
# frames `1` and `2` go to stdout and stderr; frame `x` is the agent's exit status, ours once
# the output is written.
# At stdin's end (the server leaves in order) it asks the keeper to let go, frame `d`, and
# forwards what comes until the keeper's `D` (or its end): then it exits 0, all written.
# Frames: one byte of kind, four bytes of length (big-endian), the bytes.
# Only modules of perl-base; no PERL5OPT or PERL5LIB in its environment (the exec's is fixed).

use strict;
use Fcntl qw(F_GETFL F_SETFL F_SETFD O_NONBLOCK O_RDWR O_CREAT O_NOFOLLOW LOCK_EX);
use Errno qw(EAGAIN EWOULDBLOCK EINTR ENOENT ECONNREFUSED);

# A reader gone is an error from write, not a signal that kills us before we tell.
$SIG{PIPE} = 'IGNORE';

my $LIMIT = 1 << 20;
my $CHUNK = 1 << 16;
# Longest frame the keeper may send; its are at most CHUNK.
my $MAX_FRAME = 1 << 20;
# How long an attach waits for a keeper it started to listen (keeper.py START_TIMEOUT): as
# long as the server waits for the hello, so a loaded machine starts sessions late, not never.
my $START_TIMEOUT = 30;

my $KEEPER = '/opt/pyberth/keeper.py';
# How the agent keeps itself (keeper.py BOOT, with the agent's directory): imported from its
# directory as a module `agent`, which then leaves sys.path and sys.modules.
my $AGENT_BOOT = "import sys; sys.path[:] = ['%s'] + [p for p in sys.path if p]; import agent; "
    . "del sys.path[0]; del sys.modules['agent']; agent.main(sys.argv[1:])";

# PATH's socket, connected; or undef, and whether nobody listens there (no socket, or none
# behind it): only then is a keeper started in its place; any other failure is keeper.py's.
# Perl's own socket and connect, not the Socket module (which costs ~17 ms of CPU to load
# here): AF_UNIX and SOCK_STREAM are 1 on Linux (SOCK_STREAM is 2 on MIPS, where connect fails
# otherwise and keeper.py takes over), the address is the family as a native short, then the
# path.
sub reach {
    my ($path) = @_;
    my $s;
    return ($s, 0) if socket($s, 1, 1, 0) && connect($s, pack('S', 1) . "$path\0");
    return (undef, $!{ENOENT} || $!{ECONNREFUSED});
}

# DIR is a directory of this uid that nobody else may enter (never one planted by another).
sub private { my @st = lstat($_[0]); return @st && -d _ && $st[4] == $< && !($st[2] & 077) }

# Starts our agent as its own keeper (agent.py `keep`) fully detached, as keeper.py's
# start_keeper does: a grandchild (the agent makes its own session), stdio on /dev/null,
# nothing of ours open but the ready pipe; waits until it listens, and reaches it.
sub start_agent {
    my ($sock_path, $home, @cmd) = @_;
    pipe(my $ready_r, my $ready_w) or return undef;
    my $pid = fork();
    return undef unless defined $pid;
    if ($pid == 0) {
        # Out of the exec's process group at once (the agent makes its own session).
        setpgrp(0, 0);
        my $again = fork();
        CORE::exit(1) unless defined $again;
        CORE::exit(0) if $again;
        open(STDIN, '<', '/dev/null') && open(STDOUT, '>', '/dev/null') && open(STDERR, '>', '/dev/null')
            or CORE::exit(1);
        # Perl opens its own files close-on-exec: only the ready pipe is passed on.
        fcntl($ready_w, F_SETFD, 0);
        my $boot = sprintf($AGENT_BOOT, $home);
        exec { $cmd[0] } @cmd[0 .. $#cmd - 1], '-c', $boot, 'keep', fileno($ready_w), $sock_path;
        CORE::exit(1);
    }
    close($ready_w);
    waitpid($pid, 0);
    my ($rin, $got) = ('', '');
    vec($rin, fileno($ready_r), 1) = 1;
    sysread($ready_r, $got, 1) if select(my $rout = $rin, undef, undef, $START_TIMEOUT) > 0;
    close($ready_r);
    return undef unless $got eq '1';
    my ($s) = reach($sock_path);
    return $s;
}

# The keeper's socket in DIR, connected; when no keeper answers there, our agent started as
# keeper.py attach would start it, under the same lock (so no Python interpreter runs first:
# ~40 ms); any other command, or a DIR that is not private, is keeper.py attach's (it starts
# the keeper, or says what is wrong).
sub attach {
    my ($dir, $sep, @cmd) = @_;
    exit 2 unless defined $dir && defined $sep && $sep eq '--' && @cmd;
    my $sock_path = "$dir/sock";
    my $fits = length($sock_path) < 108;
    if ($fits && private($dir)) {
        my ($s) = reach($sock_path);
        return $s if $s;
    }
    my ($home) = $cmd[-1] =~ m{\A(/[A-Za-z0-9_./-]*)/agent\.py\z};
    if ($fits && defined $home && $cmd[0] =~ m{\A[A-Za-z0-9_./-]+\z}) {
        mkdir($dir, 0700);
        my $lock;
        if (private($dir) && sysopen($lock, "$dir/lock", O_RDWR | O_CREAT | O_NOFOLLOW, 0600) && flock($lock, LOCK_EX)) {
            my ($s, $nobody) = reach($sock_path);
            my $starting = !$s && $nobody;
            $s = start_agent($sock_path, $home, @cmd) if $starting;
            close($lock);
            return $s if $s;
            if ($starting) {
                print STDERR "keeper: the keeper did not start\n";
                exit 1;
            }
        }
    }
    exec('python3', '-I', '-S', '-B', $KEEPER, 'attach', $dir, '--', @cmd);
    exit 1;
}

my $sock;
if (@ARGV && $ARGV[0] eq 'attach') {
    shift @ARGV;
    $sock = attach(@ARGV);
} else {
    my $fd = $ARGV[0];
    exit 1 unless defined $fd && $fd =~ /\A[0-9]{1,4}\z/ && $fd > 2;
    open($sock, '+<&=', $fd) or exit 1;
}
my $sfd = fileno($sock);
for my $h (\*STDIN, \*STDOUT, \*STDERR, $sock) {
    my $flags = fcntl($h, F_GETFL, 0);
    fcntl($h, F_SETFL, $flags | O_NONBLOCK) if defined $flags;
}

sub again { return $! == EAGAIN || $! == EWOULDBLOCK || $! == EINTR }

my ($to_sock, $incoming) = ('', '');
my %to_fd = (1 => '', 2 => '');
my %handle = (1 => \*STDOUT, 2 => \*STDERR);
my $status;
my $stdin_open = 1;
my $detaching = 0;
while (1) {
    my $pending_out = length($to_fd{1}) + length($to_fd{2});
    exit $status if defined $status && !$pending_out;
    my ($rin, $win) = ('', '');
    vec($rin, 0, 1) = 1 if $stdin_open && length($to_sock) < $LIMIT;
    # Little held here: what a killed relay held is lost, what the keeper holds is not.
    vec($rin, $sfd, 1) = 1 if !defined $status && $pending_out < $CHUNK;
    vec($win, $sfd, 1) = 1 if length $to_sock;
    vec($win, $_, 1) = 1 for grep { length $to_fd{$_} } (1, 2);
    my ($rout, $wout) = ($rin, $win);
    if (select($rout, $wout, undef, undef) < 0) {
        next if $! == EINTR;
        exit 1;
    }
    if (vec($rout, 0, 1)) {
        my $n = sysread(STDIN, my $data, $CHUNK);
        if (defined $n || !again()) {
            if ($n) {
                $to_sock .= pack('aN', '0', $n) . $data;
            } else {
                # The server closed its end (or it broke): the keeper finishes the frame it
                # sends, then lets go of us; what it did not send waits for the next relay.
                # The agent stays with the keeper.
                $stdin_open = 0;
                $detaching = 1;
                $to_sock .= pack('aN', 'd', 0);
            }
        }
    }
    if (vec($rout, $sfd, 1)) {
        my $n = sysread($sock, my $data, $CHUNK);
        if (defined $n || !again()) {
            if (!$n) {
                # The keeper is gone (killed, or replaced us with a newer relay).
                $status = ($detaching ? 0 : 1) unless defined $status;
                next;
            }
            $incoming .= $data;
            while (length($incoming) >= 5) {
                my ($kind, $size) = unpack('aN', $incoming);
                exit 1 if $size > $MAX_FRAME;
                last if length($incoming) < 5 + $size;
                my $payload = substr($incoming, 5, $size);
                substr($incoming, 0, 5 + $size) = '';
                if ($kind eq '1' || $kind eq '2') {
                    $to_fd{$kind} .= $payload;
                } elsif ($kind eq 'x') {
                    $status = $payload =~ /\A\s*([-+]?[0-9]{1,18})\s*\z/ ? ($1 & 0xFF) : 1;
                } elsif ($kind eq 'D') {
                    # The keeper let go of us: nothing more comes.
                    $status = 0 unless defined $status;
                }
            }
        }
    }
    # Written now, not after one more select (both ends are non-blocking: what they do not
    # take waits for the next one).
    if (length $to_sock) {
        my $n = syswrite($sock, $to_sock, $CHUNK);
        if (defined $n) {
            substr($to_sock, 0, $n) = '';
        } elsif (!again()) {
            # The keeper is gone: during a detach, nothing more comes, the rest is written.
            exit 1 unless $detaching;
            $to_sock = '';
        }
    }
    for my $out (1, 2) {
        next unless length $to_fd{$out};
        my $n = syswrite($handle{$out}, $to_fd{$out}, $CHUNK);
        if (defined $n) {
            substr($to_fd{$out}, 0, $n) = '';
        } elsif (!again()) {
            # The server's end of the stream is gone.
            exit 0;
        }
    }
}
