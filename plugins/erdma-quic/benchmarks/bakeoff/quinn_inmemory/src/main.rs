//! quinn-proto (with rustls) with no sockets: a client and a server endpoint in one process hand each other's
//! datagrams in memory; the client sends SIZE bytes one way over unidirectional streams of STREAM bytes, all
//! opened at once; virtual time advances 0.5 ms per turn (as benchmarks/quic_inmemory.py does for aioquic).
//! Prints the sender's and the receiver's MB per CPU-second.
//!
//!     quinn_inmemory CERT KEY DATAGRAM SIZE STREAM CC      (CC: reno, cubic, bbr)

use std::{
    collections::VecDeque,
    fs::File,
    io::BufReader,
    net::{IpAddr, Ipv4Addr, SocketAddr},
    sync::Arc,
    time::{Duration, Instant},
};

use bytes::BytesMut;
use quinn_proto::{
    congestion, ClientConfig, Connection, ConnectionHandle, DatagramEvent, Dir, Endpoint, EndpointConfig, Event,
    ServerConfig, TransportConfig, VarInt,
};

fn cpu() -> f64 {
    let mut ts = libc_timespec { tv_sec: 0, tv_nsec: 0 };
    unsafe { clock_gettime(2, &mut ts) }; // CLOCK_PROCESS_CPUTIME_ID
    ts.tv_sec as f64 + ts.tv_nsec as f64 / 1e9
}

#[repr(C)]
struct libc_timespec {
    tv_sec: i64,
    tv_nsec: i64,
}

extern "C" {
    fn clock_gettime(clk: i32, ts: *mut libc_timespec) -> i32;
}

struct Side {
    endpoint: Endpoint,
    addr: SocketAddr,
    conn: Option<(ConnectionHandle, Connection)>,
}

impl Side {
    /// Every datagram this side's connection (and endpoint) wants to send now.
    fn transmit(&mut self, now: Instant, out: &mut VecDeque<Vec<u8>>) {
        if let Some((ch, conn)) = self.conn.as_mut() {
            if conn.poll_timeout().map_or(false, |t| t <= now) {
                conn.handle_timeout(now);
            }
            while let Some(t) = conn.poll_transmit(now, 64) {
                match t.segment_size {
                    Some(seg) => out.extend(t.contents.chunks(seg).map(|c| c.to_vec())),
                    None => out.push_back(t.contents),
                }
            }
            while let Some(ev) = conn.poll_endpoint_events() {
                if let Some(back) = self.endpoint.handle_event(*ch, ev) {
                    conn.handle_event(back);
                }
            }
        }
        while let Some(t) = self.endpoint.poll_transmit() {
            out.push_back(t.contents);
        }
    }

    fn receive(&mut self, now: Instant, from: SocketAddr, data: Vec<u8>) {
        match self.endpoint.handle(now, from, None, None, BytesMut::from(&data[..])) {
            Some((ch, DatagramEvent::NewConnection(conn))) => self.conn = Some((ch, conn)),
            Some((_, DatagramEvent::ConnectionEvent(ev))) => self.conn.as_mut().unwrap().1.handle_event(ev),
            None => {}
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 7 {
        eprintln!("usage: {} CERT KEY DATAGRAM SIZE STREAM CC", args[0]);
        std::process::exit(2);
    }
    let datagram: u16 = args[3].parse().unwrap();
    let size: usize = args[4].parse().unwrap();
    let stream: usize = args[5].parse().unwrap();
    let certs: Vec<rustls::Certificate> = rustls_pemfile::certs(&mut BufReader::new(File::open(&args[1]).unwrap()))
        .unwrap()
        .into_iter()
        .map(rustls::Certificate)
        .collect();
    let key = rustls::PrivateKey(
        rustls_pemfile::pkcs8_private_keys(&mut BufReader::new(File::open(&args[2]).unwrap())).unwrap().remove(0),
    );
    let mut transport = TransportConfig::default();
    transport
        .initial_max_udp_payload_size(datagram)
        .max_concurrent_uni_streams(VarInt::from_u32(4096))
        .stream_receive_window(VarInt::from_u64(2 * size as u64).unwrap())
        .receive_window(VarInt::from_u64(2 * size as u64).unwrap())
        .send_window(2 * size as u64);
    match args[6].as_str() {
        "reno" => transport.congestion_controller_factory(Arc::new(congestion::NewRenoConfig::default())),
        "cubic" => transport.congestion_controller_factory(Arc::new(congestion::CubicConfig::default())),
        _ => transport.congestion_controller_factory(Arc::new(congestion::BbrConfig::default())),
    };
    let transport = Arc::new(transport);
    let mut endpoint_config = EndpointConfig::default();
    endpoint_config.max_udp_payload_size(datagram as u64).unwrap();
    let endpoint_config = Arc::new(endpoint_config);
    let mut server_config = ServerConfig::with_single_cert(certs.clone(), key).unwrap();
    server_config.transport_config(transport.clone());
    let mut roots = rustls::RootCertStore::empty();
    roots.add(&certs[0]).unwrap();
    let mut client_config = ClientConfig::with_root_certificates(roots);
    client_config.transport_config(transport);

    let ip = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1));
    let mut server = Side {
        endpoint: Endpoint::new(endpoint_config.clone(), Some(Arc::new(server_config))),
        addr: SocketAddr::new(IpAddr::V4(Ipv4Addr::new(10, 0, 0, 2)), 2),
        conn: None,
    };
    let mut client = Side { endpoint: Endpoint::new(endpoint_config, None), addr: SocketAddr::new(ip, 1), conn: None };
    let mut now = Instant::now();
    client.conn = Some(client.endpoint.connect(client_config, server.addr, "erdma").unwrap());

    let chunk = vec![0x78u8; stream];
    let (mut cpu_send, mut cpu_recv) = (0.0, 0.0);
    let (mut opened, mut got) = (false, 0usize);
    let buf = [0u8; 65536];
    let (mut out, mut back) = (VecDeque::new(), VecDeque::new());
    let mut sending: VecDeque<(quinn_proto::StreamId, usize)> = VecDeque::new();
    let mut receiving = Vec::new();
    let mut turns = 0u64;
    while got < size {
        turns += 1;
        if turns > 100_000_000 {
            eprintln!("no progress: {} of {} bytes", got, size);
            std::process::exit(1);
        }
        now += Duration::from_micros(500);
        let a = cpu();
        {
            let conn = &mut client.conn.as_mut().unwrap().1;
            while let Some(ev) = conn.poll() {
                if let Event::ConnectionLost { reason } = &ev {
                    eprintln!("client: connection lost: {}", reason);
                    std::process::exit(1);
                }
                if let Event::Connected = ev {
                    opened = true;
                    for _ in 0..size / stream {
                        let id = conn.streams().open(Dir::Uni).unwrap();
                        sending.push_back((id, 0));
                    }
                }
            }
            if opened {
                while let Some((id, sent)) = sending.front_mut() {
                    let mut s = conn.send_stream(*id);
                    match s.write(&chunk[*sent..]) {
                        Ok(n) => *sent += n,
                        Err(_) => break,
                    }
                    if *sent == stream {
                        s.finish().unwrap();
                        sending.pop_front();
                    } else {
                        break;
                    }
                }
            }
        }
        client.transmit(now, &mut out);
        let b = cpu();
        while let Some(d) = out.pop_front() {
            server.receive(now, client.addr, d);
        }
        if let Some((_, conn)) = server.conn.as_mut() {
            while conn.poll().is_some() {} // stream openings, readability: every stream is read below anyway
            while let Some(id) = conn.streams().accept(Dir::Uni) {
                receiving.push(id);
            }
            for &id in &receiving {
                if let Ok(mut rs) = conn.recv_stream(id).read(true) {
                    while let Ok(Some(chunk)) = rs.next(buf.len()) {
                        got += chunk.bytes.len();
                    }
                    let _ = rs.finalize();
                }
            }
        }
        server.transmit(now, &mut back);
        let c = cpu();
        while let Some(d) = back.pop_front() {
            client.receive(now, server.addr, d);
        }
        let d = cpu();
        cpu_send += (b - a) + (d - c);
        cpu_recv += c - b;
    }
    println!("{:.1} {:.1}", size as f64 / 1e6 / cpu_send, size as f64 / 1e6 / cpu_recv);
}
